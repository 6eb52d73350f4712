"""gpt-oss: alternating sliding/full attention with per-head sinks, and an MoE of clamped SwiGLU experts.

Attention: biases on all four projections, a learned `sinks` logit per head (an extra softmax
column dropped after the softmax), YaRN rope, windows from `config.layer_types` (a window
includes the current token). MoE: router logits -> top-k -> softmax over those k; experts
keep transformers' layout (gate_up_proj [E, H, 2I] with gate/up interleaved). Real checkpoints
ship the experts as MXFP4 `*_blocks`/`*_scales`: by default (`moe_weights="packed"`) the model
keeps those bytes as buffers and ops.moe computes from them (ops/quant/mxfp4.py), so resident
expert memory is the checkpoint's; `moe_weights="dequantized"` expands them at load to the dense
layout instead (bf16 holds every MXFP4 value exactly), the reference the packed path must equal.
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
from models.safetensors_io import Origins
from ops.quant.mxfp4 import Mxfp4Experts, check_mxfp4

MXFP4_GROUP = 32


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
    quantization_config: dict | None = None

    @property
    def has_packed_experts(self) -> bool:
        """True when the checkpoint's experts are MXFP4 and the load keeps them packed."""
        method = (self.quantization_config or {}).get("quant_method")
        return method == "mxfp4" and self.moe_weights == "packed"


class Router(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.num_local_experts, args.hidden_size))  # [E, H]
        self.bias = nn.Parameter(torch.empty(args.num_local_experts))


class Experts(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        e, h, i = args.num_local_experts, args.hidden_size, args.intermediate_size
        self.is_packed = args.has_packed_experts
        if self.is_packed:  # MXFP4 as on disk: [E, out, in/32, 16] codes, [E, out, in/32] exponents
            for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
                groups = cols // MXFP4_GROUP
                self.register_buffer(
                    f"{name}_blocks", torch.empty(e, rows, groups, 16, dtype=torch.uint8)
                )
                self.register_buffer(
                    f"{name}_scales", torch.empty(e, rows, groups, dtype=torch.uint8)
                )
        else:
            self.gate_up_proj = nn.Parameter(
                torch.empty(e, h, 2 * i)
            )  # [E, H, 2I] gate/up interleaved
            self.down_proj = nn.Parameter(torch.empty(e, i, h))  # [E, I, H]
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))

    def weights(self):
        """(gate_up, down) as ops.moe takes them: dense tensors or `Mxfp4Experts`."""
        if not self.is_packed:
            return self.gate_up_proj, self.down_proj
        return (
            Mxfp4Experts(self.gate_up_proj_blocks, self.gate_up_proj_scales),
            Mxfp4Experts(self.down_proj_blocks, self.down_proj_scales),
        )


class MoE(nn.Module):
    expert_parallel: dict = {}  # {"expert_start": s} on a rank > 0 holding experts s.. (tensor parallel)

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
        gate_up, down = ex.weights()
        out = ops.moe_gpt_oss(
            tokens,
            self.router.weight,
            self.router.bias,
            gate_up,
            ex.gate_up_proj_bias,
            down,
            ex.down_proj_bias,
            top_k=self.top_k,
            limit=self.limit,
            alpha=self.alpha,
            **self.expert_parallel,
        )
        return out.view(x.shape)


def make_layer(args: ModelArgs, layer_idx: int) -> DecoderLayer:
    bias = args.attention_bias
    attn = Attention(args, layer_idx, qkv_bias=bias, o_bias=bias, sinks=True)
    return DecoderLayer(args, attn, MoE(args))


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args, make_layer)


SANITIZE_TAKES_ORIGINS = True  # models/loader.py passes its file reads


def sanitize(
    weights: dict[str, torch.Tensor], args: ModelArgs, origins: Origins | None = None
) -> dict[str, torch.Tensor]:
    """Packed: check each MXFP4 `<name>_blocks` / `<name>_scales` pair and keep it as is.
    Dequantized: replace each pair by the dense `<name>` tensor."""
    if not args.has_packed_experts:  # with origins: dequantized at fill time (models/mxfp4.py)
        return dequantize_mxfp4_weights(weights, torch.bfloat16, origins)
    for key in [k for k in weights if k.endswith("_blocks")]:
        scale_key = key.removesuffix("_blocks") + "_scales"
        if scale_key not in weights:
            raise ValueError(f"MXFP4 tensor {key!r} has no matching {scale_key!r}")
        check_mxfp4(key, weights[key], weights[scale_key])
    return weights
