"""MLX variants of the diffusion ops: same signatures, same validation, one bridge crossing each.

Imported only when the ops table routes a diffusion op to MLX (TORCH_RUNNER_USE_MLX=1). Each op
validates its torch arguments first (same errors as the torch reference), then crosses once
through `bridge.mlx_call`: one producer fence, one `mx.eval`, DLPack back. The math mirrors the
torch reference (fp32 inside, one rounding to x's dtype). The seed's lesson applies: a crossing
per norm costs more than the norm on small activations; docs/perf_sections/diffusion.md has the
numbers measured here.
"""

from __future__ import annotations

import mlx.core as mx
import torch

from bridge import mlx_call
from ops.diffusion.modulation import broadcast_modulation
from ops.diffusion.norm import check_norm_params
from ops.diffusion.rotary import check_rope_args


@mlx_call
def _norm_infer(x, weight, bias, eps, is_rms_norm):
    x32 = x.astype(mx.float32)  # [..., D]
    w32 = None if weight is None else weight.astype(mx.float32)
    b32 = None if bias is None else bias.astype(mx.float32)
    if is_rms_norm:
        out = mx.fast.rms_norm(x32, w32, eps)
        if b32 is not None:
            out = out + b32
    else:
        out = mx.fast.layer_norm(x32, w32, b32, eps)
    return out.astype(x.dtype)


@mlx_call
def _modulate(x, shift, scale):
    x32 = x.astype(mx.float32)  # [B, N, D]
    return (x32 * (1.0 + scale.astype(mx.float32)) + shift.astype(mx.float32)).astype(x.dtype)


@mlx_call
def _dit_rope(x, cos, sin, is_interleaved, sequence_dim):
    cos32, sin32 = cos.astype(mx.float32), sin.astype(mx.float32)  # [S, D]
    if sequence_dim == 1:
        cos32, sin32 = cos32[:, None, :], sin32[:, None, :]  # [S, 1, D]
    x32 = x.astype(mx.float32)
    if is_interleaved:
        pairs = x32.reshape(*x.shape[:-1], -1, 2)  # [..., D/2, 2]
        rotated = mx.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    else:
        first, second = mx.split(x32, 2, axis=-1)
        rotated = mx.concatenate([-second, first], axis=-1)
    return (x32 * cos32 + rotated * sin32).astype(x.dtype)


def norm_infer(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    is_rms_norm: bool = False,
) -> torch.Tensor:
    """MLX `ops.diffusion.norm.norm_infer`: x [..., D], weight/bias [D] or None -> x's dtype."""
    check_norm_params(x, weight, bias, eps)
    return _norm_infer(x, weight, bias, float(eps), bool(is_rms_norm))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MLX `ops.diffusion.modulation.modulate`: x [B, N, D], shift/scale [B, D] or broadcastable."""
    shift = broadcast_modulation(x, "shift", shift)
    scale = broadcast_modulation(x, "scale", scale)
    return _modulate(x, shift, scale)


def dit_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    is_interleaved: bool = True,
    sequence_dim: int = 2,
) -> torch.Tensor:
    """MLX `ops.diffusion.rotary.dit_rope`: x [B, H, S, D] / [B, S, H, D], cos/sin [S, D]."""
    check_rope_args(x, cos, sin, sequence_dim)
    return _dit_rope(x, cos, sin, bool(is_interleaved), int(sequence_dim))
