"""Qwen3-MoE: Qwen3 attention (q/k norm) with sparse MoE feed-forward layers.

A layer is sparse unless it is in `mlp_only_layers` or off the `decoder_sparse_step` grid
(those keep a dense GatedMLP of `intermediate_size`). Router: softmax over all experts in fp32,
top-k, renormalised when `norm_topk_prob`. Experts are stored as transformers 5 does:
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]; Hub checkpoints
that keep one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...) are stacked by
`sanitize`. With `use_sliding_window`, every layer is windowed (as transformers does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

import ops
from models.args import FULL_ATTENTION, SLIDING_ATTENTION
from models.args import ModelArgs as BaseArgs
from models.layers import Attention, CausalLM, DecoderLayer, GatedMLP
from models.safetensors_io import Origins, stack_reads


@dataclass
class ModelArgs(BaseArgs):
    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = (
        *BaseArgs.REQUIRED_FIELDS,
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
    )

    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    use_sliding_window: bool = False

    def derive_layer_types(self, values: dict[str, Any]) -> list[str]:
        kind = SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION
        return [kind] * self.num_hidden_layers

    def is_sparse_layer(self, layer_idx: int) -> bool:
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class Experts(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        e, h, i = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # [E, 2I, H]: gate rows, then up
        self.down_proj = nn.Parameter(torch.empty(e, h, i))  # [E, H, I]


class Router(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))  # [E, H]


class SparseMoeBlock(nn.Module):
    expert_parallel: dict = {}  # {"expert_start": s} on a rank > 0 holding experts s.. (tensor parallel)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Router(args)
        self.experts = Experts(args)
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [T, H]
        out = ops.moe_qwen3(
            tokens,
            self.gate.weight,
            self.experts.gate_up_proj,
            self.experts.down_proj,
            top_k=self.top_k,
            norm_topk_prob=self.norm_topk_prob,
            **self.expert_parallel,
        )
        return out.view(x.shape)


def make_layer(args: ModelArgs, layer_idx: int) -> DecoderLayer:
    bias = args.attention_bias
    attn = Attention(args, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=True)
    if args.is_sparse_layer(layer_idx):
        mlp = SparseMoeBlock(args)
    else:
        mlp = GatedMLP(args.hidden_size, args.intermediate_size, act=args.hidden_act)
    return DecoderLayer(args, attn, mlp)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args, make_layer)


SANITIZE_TAKES_ORIGINS = True  # models/loader.py passes its file reads (stacks read lazily)
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def sanitize(
    weights: dict[str, torch.Tensor], args: ModelArgs, origins: Origins | None = None
) -> dict[str, torch.Tensor]:
    """Stack per-expert Hub tensors into the fused [E, ...] parameters. With `origins` (the
    loader's record of file reads) the stacks are meta tensors read later, each expert's tensors
    straight into its rows (safetensors_io.stack_reads): no stacked copy beside the parts."""
    grouped: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, tensor in weights.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        grouped.setdefault(prefix, {}).setdefault(proj, {})[expert] = tensor
    for prefix, projs in grouped.items():
        parts = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            experts = projs.get(proj, {})
            if sorted(experts) != list(range(args.num_experts)):
                missing = sorted(set(range(args.num_experts)) - set(experts))
                raise ValueError(
                    f"{prefix}: {proj} is missing expert(s) {missing} of {args.num_experts}"
                )
            parts[proj] = [experts[e] for e in range(args.num_experts)]  # each [out, in]
        gate_up = [[g, u] for g, u in zip(parts["gate_proj"], parts["up_proj"])]
        down = [[d] for d in parts["down_proj"]]
        for stacked, rows in (("gate_up_proj", gate_up), ("down_proj", down)):
            name = f"{prefix}.{stacked}"
            lazy = stack_reads(rows, origins, name)  # [E, 2I, H] (gate rows, then up); [E, H, I]
            out[name] = lazy if lazy is not None else torch.stack([torch.cat(r) for r in rows])
    return out
