"""Megatron-style sharding of a decoder built on `meta`, before any weight is read.

`ShardPlan.prepare(model)` rewrites the meta model to this rank's shapes: q/k/v and gate/up are
column-parallel (each rank its heads / its slice of the intermediate), o_proj and down_proj are
row-parallel with one all-reduce on the attention block's and the MLP's output (forward hooks,
so the family files stay unchanged), the embedding and lm_head are vocab-parallel (the
embedding sums the ranks' rows; logits are gathered by the runner). When there are fewer KV
heads than ranks each rank keeps the one KV head its query heads read (replicated). MoE
experts: experts.py. The plan then maps every checkpoint tensor name to this rank's slice
(`shard_tensor`); slice_read.py reads a one-dimension slice alone from the file. Row-parallel
biases live on rank 0 only. Packed weights stay packed per rank: int8 row-parallel scales are the
whole row's (`int8_amax`); a GGUF's rows and Q4 blocks are cut before decoding
(models/gguf_loader.py); an fp8 checkpoint's scales are cut with their weights (`shard_fp8_scales`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from models.fp8 import SCALE_SUFFIXES as FP8_SCALE_SUFFIXES
from models.layers import Attention, CausalLM, GatedMLP
from torch_runner.distributed.experts import MOE_MODULES, narrow, rename_raw, shard_experts
from torch_runner.distributed.slice_read import read_shard


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
    slices: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    rank0_only: set[str] = field(default_factory=set)
    # checkpoint names sliced before the family's sanitize (per-expert Hub tensors it stacks),
    # and the stacked names they make (then already this rank's part)
    raw_slices: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], tuple[str, ...]]] = field(
        default_factory=dict
    )
    num_kv_heads: int = 0  # this rank's KV heads (the paged pool's geometry)
    row_parallel: set[str] = field(default_factory=set)  # linears split along their input
    expert_parallel: bool = False  # MoE: whole experts per rank (experts.py)
    num_local_experts: int = 0  # expert parallel: this rank's experts
    raw_renames: dict[str, str | None] = field(default_factory=dict)  # per-expert names (EP)
    presliced: set[str] = field(default_factory=set)  # read as this rank's part (slice_read)

    def int8_amax(self, name: str):
        """For int8 quantization (models/quantize.py): a row-parallel weight's per-row maxima
        are the whole row's (max over the ranks), so every rank's scales are the one-rank
        model's and its int8 codes are that model's codes, columns sliced."""
        return self.group.all_reduce_max if name in self.row_parallel else None

    def prepare(self, model: CausalLM) -> None:
        """Rewrite the meta model to this rank's shapes and install the all-reduce hooks."""
        for name, module in model.named_modules():
            if isinstance(module, Attention):
                self._shard_attention(name, module)
            elif isinstance(module, GatedMLP):
                self._shard_mlp(name, module)
            elif isinstance(module, MOE_MODULES):
                shard_experts(self, name, module)
                module.register_forward_hook(self._reduce_output)
        self._shard_vocab(model)

    def _column(self, prefix: str, linear: nn.Linear, start: int, size: int) -> nn.Linear:
        new = nn.Linear(linear.in_features, size, bias=linear.bias is not None, device="meta")
        self.slices[f"{prefix}.weight"] = narrow(0, start, size)
        if linear.bias is not None:
            self.slices[f"{prefix}.bias"] = narrow(0, start, size)
        return new

    def _row(self, prefix: str, linear: nn.Linear, start: int, size: int) -> nn.Linear:
        new = nn.Linear(size, linear.out_features, bias=linear.bias is not None, device="meta")
        self.slices[f"{prefix}.weight"] = narrow(1, start, size)
        self.row_parallel.add(prefix)
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
            self.slices[f"{name}.sinks"] = narrow(0, r * local_q, local_q)
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
        self.slices["model.embed_tokens.weight"] = narrow(0, start, real, pad)
        if model.lm_head is not None:
            with torch.device("meta"):
                model.lm_head = nn.Linear(hidden, per_rank, bias=False)
            self.slices["lm_head.weight"] = narrow(0, start, real, pad)

    def _reduce_output(self, module, inputs, output: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(output)  # row-parallel partial sums -> the full output

    def shard_raw_weights(self, weights: dict[str, torch.Tensor], args):
        """The checkpoint's tensors before the family's sanitize, cut to this rank's part, and
        the args sanitize checks them against (expert parallel: this rank's expert count)."""
        weights = rename_raw(self, {name: self.shard_raw(name, t) for name, t in weights.items()})
        if self.num_local_experts and hasattr(args, "num_experts"):
            args = copy.copy(args)
            args.num_experts = self.num_local_experts
        return weights, args

    def shard_raw(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Checkpoint tensor `name` before sanitize: a per-expert tensor is cut to this rank's
        part here, so the stacked experts are never built whole."""
        entry = self.raw_slices.get(name)
        if entry is None:
            return tensor
        cut, stacked = entry
        for done in stacked:
            self.slices.pop(done, None)
        return tensor if name in self.presliced else cut(tensor).contiguous()

    def cuts(self, name: str) -> bool:
        """Whether `shard_tensor` changes checkpoint tensor `name` (not read as its part)."""
        is_zeroed = name in self.rank0_only and self.rank != 0
        return is_zeroed or (name not in self.presliced and name in self.slices)

    def shard_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (a copy of the slice only)."""
        if name in self.rank0_only and self.rank != 0:
            return torch.zeros_like(tensor)
        cut = None if name in self.presliced else self.slices.get(name)
        return tensor if cut is None else cut(tensor).contiguous()

    def shard_fp8_scales(self, weights: dict[str, torch.Tensor], block) -> dict:
        """An fp8 checkpoint's scales (models/fp8.py) cut like their weights: a per-tensor scale
        stays whole, a per-channel one follows its weight's rows (whole when the columns are
        split), a block one is cut at block boundaries (checks.check_fp8_shards)."""
        out = dict(weights)
        for name, scale in weights.items():
            suffix = next((x for x in FP8_SCALE_SUFFIXES if name.endswith(x)), None)
            spec = suffix and getattr(self.slices.get(name.removesuffix(suffix) + ".weight"),
                                      "spec", None)  # fmt: skip
            if spec is None or (block is None and scale.numel() == 1):
                continue
            dim, start, length, pad = spec
            if block is None:  # per channel: [N] or [N, 1], one scale per output row
                out[name] = scale if dim else narrow(0, start, length, pad)(scale).contiguous()
                continue
            size = block[dim]
            first, count = start // size, -(-length // size)
            if start % size or pad or (length % size and first + count != scale.shape[dim]):
                raise ValueError(
                    f"tensor_parallel_size={self.size}: the {name} shard ({start}..{start + length}"
                    f" along dim {dim}) would split the fp8 checkpoint's {size}-wide scale blocks"
                )
            out[name] = narrow(dim, first, count)(scale).contiguous()
        return out

    def read_checkpoint(self, files, origins=None) -> dict[str, torch.Tensor]:
        """The checkpoint with each one-dimension slice read as this rank's part only."""
        return read_shard(self, files, origins)
