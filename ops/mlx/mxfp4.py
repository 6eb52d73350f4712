"""MLX twin of the packed-MXFP4 gpt-oss MoE: MLX's own mxfp4 kernels, no dequantised copy.

The checkpoint's layout *is* MLX's `mode="mxfp4"` layout (tests/test_ops_quant_mxfp4.py checks
it against mx.dequantize and mx.quantize): a row's bytes read as little-endian uint32 hold
eight E2M1 codes, element 2j in the low nibble of byte j, and the uint8 scales are the same
E8M0 exponents. So blocks [E, R, G, 16] become the [E, R, G*4] uint32 weight by a view, and
`mx.gather_qmm` runs every (token, slot) pair against its expert with no host round trip.
"""

from __future__ import annotations

import mlx.core as mx
import torch

from bridge import mlx_call
from ops.quant.mxfp4 import GROUP_SIZE, Mxfp4Experts


def _as_mlx_weight(blocks):
    num_experts, rows, groups, group_bytes = blocks.shape
    return blocks.reshape(num_experts, rows, groups * group_bytes).view(mx.uint32)  # [E, R, C/8]


def _gather(x, blocks, scales, idx):
    return mx.gather_qmm(
        x, _as_mlx_weight(blocks), scales, None, rhs_indices=idx, transpose=True,
        group_size=GROUP_SIZE, bits=4, mode="mxfp4",
    )  # fmt: skip


def moe_gpt_oss_mxfp4_mx(
    x, router_weight, router_bias, gu_blocks, gu_scales, gu_bias, dn_blocks, dn_scales, dn_bias,
    *, top_k, limit, alpha,
):  # fmt: skip
    logits = mx.addmm(router_bias, x, router_weight.T)  # [T, E]; one rounding, as torch
    idx = mx.argpartition(-logits, kth=top_k - 1, axis=-1)[..., :top_k]  # [T, k]
    top = mx.take_along_axis(logits, idx, axis=-1)
    scores = mx.softmax(top.astype(mx.float32), axis=-1).astype(x.dtype)  # [T, k]
    h = _gather(x[:, None, None, :], gu_blocks, gu_scales, idx)[:, :, 0]  # [T, k, 2I]
    h = h + gu_bias[idx]
    gate = mx.minimum(h[..., ::2], limit)
    up = mx.clip(h[..., 1::2], -limit, limit)
    h = (up + 1) * (gate * mx.sigmoid(gate * alpha))  # [T, k, I]
    y = _gather(h[:, :, None, :], dn_blocks, dn_scales, idx)[:, :, 0] + dn_bias[idx]  # [T, k, H]
    return (y * scores[..., None]).sum(axis=1).astype(x.dtype)


def moe_gpt_oss_mxfp4(
    x: torch.Tensor,
    router_weight,
    router_bias,
    gate_up_proj: Mxfp4Experts,
    gate_up_proj_bias,
    down_proj: Mxfp4Experts,
    down_proj_bias,
    *,
    top_k: int,
    limit: float = 7.0,
    alpha: float = 1.702,
) -> torch.Tensor:
    """Same contract as ops.quant.mxfp4.moe_gpt_oss_mxfp4; one MLX crossing."""
    return mlx_call(
        moe_gpt_oss_mxfp4_mx,
        x,
        router_weight,
        router_bias,
        gate_up_proj.blocks,
        gate_up_proj.scales,
        gate_up_proj_bias,
        down_proj.blocks,
        down_proj.scales,
        down_proj_bias,
        top_k=top_k,
        limit=limit,
        alpha=alpha,
    )
