"""MXFP4 expert weights kept packed, and the gpt-oss MoE computed from them.

Why packed: gpt-oss ships its experts as MXFP4 (`<name>_blocks` [E, R, G, 16] uint8, two FP4
E2M1 codes per byte, the LOW nibble holding the even element; `<name>_scales` [E, R, G] uint8,
one exponent 2^(s - 127) per 32 elements). Expanded to bf16 they are 3.8x larger (35.6 GiB
against 9.5 GiB for gpt-oss-20b). Each expert matrix is the row-major [R, C] = [out, in] weight,
so an expert computes `x @ W.T`.

Backends, chosen per call by the weight's device (the routing is ops.moe's, unchanged):
- CUDA: Triton kernels read the bytes and scales and multiply in registers: per (token, expert)
  pair for decode-sized steps, over per-expert token lists on the tensor cores for larger ones;
  no host sync, so CUDA graphs capture it (ops/quant/mxfp4_triton.py).
- everything else (CPU, MPS): only the experts this step routes to are dequantised, in tiles
  of at most TILE_ELEMENTS values, each tile consumed by one matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ops.fused import kernels_for
from ops.linear import linear
from ops.routing import local_experts, route_groups

# FP4 E2M1 code -> value: bit 3 is the sign, bits 0-2 index (0, 0.5, 1, 1.5, 2, 3, 4, 6).
FP4_E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
SCALE_BIAS = 127
GROUP_SIZE = 32  # values per scale
TILE_ELEMENTS = 1 << 21  # dequantised values alive at once in the tiled path (8 MiB in fp32)
FUSED_ROUTER = True  # CUDA: route()'s top-k + softmax in one Triton launch (3 torch launches)


@dataclass(frozen=True)
class Mxfp4Experts:
    """One packed expert tensor: blocks [E, R, G, 16] uint8 and scales [E, R, G] uint8 (as on disk).

    Expert e's weight is the [R, C] matrix (C = 32 G) applied as `x @ W[e].T`.
    """

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        check_mxfp4("Mxfp4Experts", self.blocks, self.scales)

    @property
    def num_experts(self) -> int:
        return self.blocks.shape[0]

    @property
    def out_features(self) -> int:
        return self.blocks.shape[1]

    @property
    def in_features(self) -> int:
        return self.blocks.shape[2] * GROUP_SIZE

    @property
    def device(self) -> torch.device:
        return self.blocks.device


def check_mxfp4(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Reject blocks/scales that are not uint8 [E, R, G, 16] / [E, R, G]; the error names `name`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"{name}: MXFP4 blocks/scales must be uint8, found {blocks.dtype}/{scales.dtype}"
        )
    if (
        blocks.dim() != 4
        or blocks.shape[-1] != GROUP_SIZE // 2
        or blocks.shape[:-1] != scales.shape
    ):
        raise ValueError(
            f"{name}: MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            f"(expected blocks [E, R, G, {GROUP_SIZE // 2}] and scales [E, R, G])"
        )


def _pair_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: byte -> (value of the low nibble, value of the high nibble)."""
    values = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=1).to(
        dtype=dtype, device=device
    )


def dequantize_rows(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., R, G, 16] uint8 blocks + [..., R, G] scales -> [..., R, G*32] in `dtype`, exactly.

    Every MXFP4 value is a power-of-two multiple of an E2M1 value, so bf16 and fp32 hold it
    exactly; fp16 could overflow, so it is built in fp32 and cast once.
    """
    work = torch.float32 if dtype == torch.float16 else dtype
    table = _pair_table(work, blocks.device)
    values = F.embedding(blocks.to(torch.int32), table)  # [..., R, G, 16, 2]
    exponent = scales.to(torch.int32) - SCALE_BIAS
    scale = torch.ldexp(torch.ones((), device=blocks.device), exponent.float()).to(work)
    dense = values.flatten(-2) * scale[..., None]  # [..., R, G, 32]
    return dense.flatten(-2).to(dtype)


def dequantize(packed: Mxfp4Experts, dtype: torch.dtype) -> torch.Tensor:
    """All experts, dense, in the model's layout [E, C, R] (W transposed, as transformers keeps it)."""
    return dequantize_rows(packed.blocks, packed.scales, dtype).transpose(1, 2).contiguous()


def expert_linear(
    x: torch.Tensor, packed: Mxfp4Experts, expert: int, bias: torch.Tensor
) -> torch.Tensor:
    """x [t, C] @ W[expert].T + bias -> [t, R], dequantising W in row tiles of TILE_ELEMENTS.

    Each tile is laid out [C, tile] and multiplied then biased exactly as the dense reference
    (`x @ dense[expert] + bias`), so both round the same way.
    """
    rows = packed.out_features
    tile = max(1, TILE_ELEMENTS // packed.in_features)
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    for start in range(0, rows, tile):
        stop = min(start + tile, rows)
        blocks = packed.blocks[expert, start:stop]
        weight = dequantize_rows(blocks, packed.scales[expert, start:stop], x.dtype)  # [tile, C]
        out[:, start:stop] = x @ weight.T.contiguous() + bias[start:stop]
    return out


def moe_gpt_oss_mxfp4(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor,
    gate_up_proj: Mxfp4Experts,
    gate_up_proj_bias: torch.Tensor,
    down_proj: Mxfp4Experts,
    down_proj_bias: torch.Tensor,
    *,
    top_k: int,
    limit: float = 7.0,
    alpha: float = 1.702,
    expert_start: int = 0,
) -> torch.Tensor:
    """ops.moe.moe_gpt_oss over packed experts: gate_up [E, 2I, H/32, 16], down [E, H, I/32, 16].

    Same routing (top-k router logits, softmax over those k) and clamped SwiGLU; x [T, H] -> [T, H].
    """
    if gate_up_proj.in_features != x.shape[-1] or down_proj.out_features != x.shape[-1]:
        raise ValueError(
            f"moe_gpt_oss: packed experts are [{gate_up_proj.out_features}, {gate_up_proj.in_features}] "
            f"and [{down_proj.out_features}, {down_proj.in_features}]; x has hidden size {x.shape[-1]}"
        )
    top_idx, scores = route(x, router_weight, router_bias, top_k)
    num_local = gate_up_proj.num_experts
    if num_local != router_weight.shape[0]:  # expert parallel (ops.routing.local_experts)
        top_idx, scores = local_experts(top_idx, scores, expert_start, num_local)
    if x.device.type == "cuda":
        from ops.quant.mxfp4_triton import moe_experts_mxfp4

        return moe_experts_mxfp4(
            x, top_idx, scores, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias,
            limit, alpha, is_expert_parallel=num_local != router_weight.shape[0],
        )  # fmt: skip
    out = torch.zeros_like(x)
    for expert, rows, slots in route_groups(top_idx, num_local):
        h = expert_linear(x[rows], gate_up_proj, expert, gate_up_proj_bias[expert])  # [t, 2I]
        h = swiglu(h, limit, alpha)  # [t, I]
        y = expert_linear(h, down_proj, expert, down_proj_bias[expert])  # [t, H]
        out.index_add_(0, rows, (y * scores[rows, slots, None]).to(x.dtype))
    return out


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int):
    """gpt-oss routing: (top_idx [T, k], scores [T, k]) = top-k of the router logits and the
    softmax over those k. CUDA: the top-k and softmax in one Triton launch (ops/routing_triton.py;
    ties go to the lowest expert index, as torch.topk's CUDA kernel does); elsewhere torch ops."""
    logits = linear(x, weight, bias)  # [T, E]
    if x.is_cuda and FUSED_ROUTER:
        from ops.routing_triton import top_k_softmax

        return top_k_softmax(logits, top_k)
    top_val, top_idx = torch.topk(logits, top_k, dim=-1)  # [T, k]
    return top_idx, torch.softmax(top_val, dim=-1)


def swiglu(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU over interleaved gate/up columns: [t, 2I] -> [t, I]."""
    kernels = kernels_for(h)  # one Triton kernel on CUDA (ops/fused), the same values
    if kernels is not None:
        return kernels.clamped_swiglu(h, limit, alpha)
    gate = h[:, ::2].clamp(max=limit)
    up = h[:, 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
