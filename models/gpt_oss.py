"""gpt-oss: alternating sliding/full attention with per-head sinks, and an MoE of clamped SwiGLU experts.

Attention: biases on all four projections, a learned `sinks` logit per head (an extra softmax
column dropped after the softmax), YaRN rope, windows from `config.layer_types` (a window
includes the current token). MoE: router logits -> top-k -> softmax over those k; experts
keep transformers' layout (gate_up_proj [E, H, 2I] with gate/up interleaved). Real checkpoints
ship the experts as MXFP4 `*_blocks`/`*_scales`; `sanitize` dequantises them (bf16 holds every
MXFP4 value exactly, so no precision is lost before the cast to the serving dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

import ops
from models.args import ModelArgs as BaseArgs
from models.layers import Attention, CausalLM, DecoderLayer
from models.mxfp4 import dequantize_mxfp4_weights


@dataclass
class ModelArgs(BaseArgs):
    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = (
        *BaseArgs.REQUIRED_FIELDS,
        "num_local_experts",
        "num_experts_per_tok",
    )

    num_local_experts: int = 0
    num_experts_per_tok: int = 1
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    attention_bias: bool = True


class Router(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.num_local_experts, args.hidden_size))  # [E, H]
        self.bias = nn.Parameter(torch.empty(args.num_local_experts))


class Experts(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        e, h, i = args.num_local_experts, args.hidden_size, args.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))  # [E, H, 2I] interleaved gate/up
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))  # [E, I, H]
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.router = Router(args)
        self.experts = Experts(args)
        self.top_k = args.num_experts_per_tok
        self.limit = args.swiglu_limit
        self.alpha = args.swiglu_alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [T, H]
        ex = self.experts
        out = ops.moe_gpt_oss(
            tokens,
            self.router.weight,
            self.router.bias,
            ex.gate_up_proj,
            ex.gate_up_proj_bias,
            ex.down_proj,
            ex.down_proj_bias,
            top_k=self.top_k,
            limit=self.limit,
            alpha=self.alpha,
        )
        return out.view(x.shape)


def make_layer(args: ModelArgs, layer_idx: int) -> DecoderLayer:
    bias = args.attention_bias
    attn = Attention(args, layer_idx, qkv_bias=bias, o_bias=bias, sinks=True)
    return DecoderLayer(args, attn, MoE(args))


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args, make_layer)


def sanitize(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Dequantise MXFP4 expert tensors (`<name>_blocks` + `<name>_scales` -> `<name>`)."""
    return dequantize_mxfp4_weights(weights, torch.bfloat16)
