"""Megatron-style sharding of a decoder built on `meta`, before any weight is read.

`ShardPlan.prepare(model)` rewrites the meta model to this rank's shapes: q/k/v and gate/up are
column-parallel (each rank its heads / its slice of the intermediate), o_proj and down_proj are
row-parallel with one all-reduce on the attention block's and the MLP's output (forward hooks,
so the family files stay unchanged), the embedding and lm_head are vocab-parallel (the
embedding sums the ranks' rows; logits are gathered by the runner). When there are fewer KV
heads than ranks each rank keeps the one KV head its query heads read (replicated). The plan
then maps every checkpoint tensor name to this rank's slice (`shard_tensor`), so a rank copies
only its part of the memory-mapped checkpoint. Row-parallel biases live on rank 0 only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import Attention, CausalLM, GatedMLP

# families whose blocks are all Attention + GatedMLP (MoE and Gemma's scaled embedding: later)
SHARDABLE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def check_shardable(raw_config: dict, size: int) -> None:
    """One clear error before loading for a family or a geometry that cannot split `size` ways."""
    model_type = raw_config.get("model_type")
    if model_type not in SHARDABLE_FAMILIES:
        raise ValueError(
            f"tensor_parallel_size={size} is not supported for model_type {model_type!r}; "
            f"supported families: {', '.join(SHARDABLE_FAMILIES)}"
        )
    heads = raw_config.get("num_attention_heads")
    kv_heads = raw_config.get("num_key_value_heads", heads)
    inter = raw_config.get("intermediate_size")
    if not heads or heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads ({heads})")
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} must divide num_key_value_heads ({kv_heads}) "
            "or be a multiple of it"
        )
    if inter is None or inter % size:
        raise ValueError(f"tensor_parallel_size={size} must divide intermediate_size ({inter})")


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + num_local) of the embedding; the ranks' lookups summed."""

    def __init__(self, num_local: int, hidden: int, start: int, group):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_local, hidden))
        self.start, self.num_local, self.group = start, num_local, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        is_mine = (local >= 0) & (local < self.num_local)  # [B, N]
        out = F.embedding(local.clamp(0, self.num_local - 1), self.weight)  # [B, N, H]
        out = out * is_mine.unsqueeze(-1).to(out.dtype)
        return self.group.all_reduce(out)


@dataclass
class ShardPlan:
    """How this rank (`rank` of `size`) slices each tensor; filled by `prepare`."""

    rank: int
    size: int
    group: object  # TPGroup: all_reduce / all_gather_last
    slices: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)  # dim,start,len,pad
    rank0_only: set[str] = field(default_factory=set)
    num_kv_heads: int = 0  # this rank's KV heads (the paged pool's geometry)

    def prepare(self, model: CausalLM) -> None:
        """Rewrite the meta model to this rank's shapes and install the all-reduce hooks."""
        for name, module in model.named_modules():
            if isinstance(module, Attention):
                self._shard_attention(name, module)
            elif isinstance(module, GatedMLP):
                self._shard_mlp(name, module)
        self._shard_vocab(model)

    def _column(self, prefix: str, linear: nn.Linear, start: int, size: int) -> nn.Linear:
        new = nn.Linear(linear.in_features, size, bias=linear.bias is not None, device="meta")
        self.slices[f"{prefix}.weight"] = (0, start, size, 0)
        if linear.bias is not None:
            self.slices[f"{prefix}.bias"] = (0, start, size, 0)
        return new

    def _row(self, prefix: str, linear: nn.Linear, start: int, size: int) -> nn.Linear:
        new = nn.Linear(size, linear.out_features, bias=linear.bias is not None, device="meta")
        self.slices[f"{prefix}.weight"] = (1, start, size, 0)
        if linear.bias is not None:
            self.rank0_only.add(f"{prefix}.bias")  # added once, by rank 0, before the sum
        return new

    def _shard_attention(self, name: str, attn: Attention) -> None:
        hq, hkv, d, r, n = attn.num_heads, attn.num_kv_heads, attn.head_dim, self.rank, self.size
        local_q = hq // n
        if hkv >= n:
            local_kv, kv_start = hkv // n, r * (hkv // n)
        else:  # fewer KV heads than ranks: the KV head this rank's query heads share
            local_kv, kv_start = 1, (r * local_q) // (hq // hkv)
        attn.q_proj = self._column(f"{name}.q_proj", attn.q_proj, r * local_q * d, local_q * d)
        attn.k_proj = self._column(f"{name}.k_proj", attn.k_proj, kv_start * d, local_kv * d)
        attn.v_proj = self._column(f"{name}.v_proj", attn.v_proj, kv_start * d, local_kv * d)
        attn.o_proj = self._row(f"{name}.o_proj", attn.o_proj, r * local_q * d, local_q * d)
        if attn.sinks is not None:
            attn.sinks = nn.Parameter(torch.empty(local_q, device="meta"))
            self.slices[f"{name}.sinks"] = (0, r * local_q, local_q, 0)
        attn.num_heads, attn.num_kv_heads = local_q, local_kv
        self.num_kv_heads = local_kv
        attn.register_forward_hook(self._reduce_output)

    def _shard_mlp(self, name: str, mlp: GatedMLP) -> None:
        size = mlp.gate_proj.out_features // self.size
        start = self.rank * size
        mlp.gate_proj = self._column(f"{name}.gate_proj", mlp.gate_proj, start, size)
        mlp.up_proj = self._column(f"{name}.up_proj", mlp.up_proj, start, size)
        mlp.down_proj = self._row(f"{name}.down_proj", mlp.down_proj, start, size)
        mlp.register_forward_hook(self._reduce_output)

    def _shard_vocab(self, model: CausalLM) -> None:
        embed = model.model.embed_tokens
        vocab, hidden = embed.weight.shape
        per_rank = -(-vocab // self.size)  # padded: the last rank's extra rows are zeros
        start = self.rank * per_rank
        real = max(0, min(per_rank, vocab - start))
        pad = per_rank - real
        with torch.device("meta"):
            model.model.embed_tokens = VocabParallelEmbedding(per_rank, hidden, start, self.group)
        self.slices["model.embed_tokens.weight"] = (0, start, real, pad)
        if model.lm_head is not None:
            with torch.device("meta"):
                model.lm_head = nn.Linear(hidden, per_rank, bias=False)
            self.slices["lm_head.weight"] = (0, start, real, pad)

    def _reduce_output(self, module, inputs, output: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(output)  # row-parallel partial sums -> the full output

    def shard_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (a copy of the slice only)."""
        if name in self.rank0_only and self.rank != 0:
            return torch.zeros_like(tensor)
        spec = self.slices.get(name)
        if spec is None:
            return tensor
        dim, start, length, pad = spec
        part = tensor.narrow(dim, start, length)
        if pad:
            shape = list(part.shape)
            shape[dim] = pad
            part = torch.cat([part, part.new_zeros(shape)], dim=dim)
        return part.contiguous()
