"""MLX RMSNorm / LayerNorm (mx.fast) with the torch ops' signatures and dtype contract."""

from __future__ import annotations

import mlx.core as mx
import torch

from bridge import mlx_call


def rms_norm_mx(x, weight, eps: float):
    """mx.fast.rms_norm accumulates in fp32; a fp32 weight promotes, so round once to x's dtype."""
    return mx.fast.rms_norm(x, weight, eps).astype(x.dtype)


def layer_norm_mx(x, weight, bias, eps: float):
    return mx.fast.layer_norm(x, weight, bias, eps).astype(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Same contract as ops.norm.rms_norm; one MLX crossing."""
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight must be [{x.shape[-1]}]; got {tuple(weight.shape)}")
    return mlx_call(rms_norm_mx, x, weight, eps)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Same contract as ops.norm.layer_norm; one MLX crossing."""
    hidden = x.shape[-1]
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and param.shape != (hidden,):
            raise ValueError(f"layer_norm: {name} must be [{hidden}]; got {tuple(param.shape)}")
    return mlx_call(layer_norm_mx, x, weight, bias, eps)
