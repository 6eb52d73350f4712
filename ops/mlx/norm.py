"""MLX RMSNorm / LayerNorm (mx.fast) with the torch ops' signatures and dtype contract."""

from __future__ import annotations

import mlx.core as mx
import torch

from bridge import mlx_call
from ops.norm import check_norm_shapes


def rms_norm_mx(x, weight, eps: float):
    """mx.fast.rms_norm accumulates in fp32; a fp32 weight promotes, so round once to x's dtype."""
    return mx.fast.rms_norm(x, weight, eps).astype(x.dtype)


def layer_norm_mx(x, weight, bias, eps: float):
    return mx.fast.layer_norm(x, weight, bias, eps).astype(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Same contract as ops.norm.rms_norm; one MLX crossing."""
    check_norm_shapes("rms_norm", x, weight)
    return mlx_call(rms_norm_mx, x, weight, eps)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Same contract as ops.norm.layer_norm; one MLX crossing."""
    check_norm_shapes("layer_norm", x, weight, bias)
    return mlx_call(layer_norm_mx, x, weight, bias, eps)
