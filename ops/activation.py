"""Gated activations of the feed-forward blocks: SiLU-mul (Llama/Qwen) and gpt-oss's clamped SwiGLU.

The torch expressions here are the references (and the path off CUDA); on CUDA each is one
Triton kernel (ops/fused) that rounds where these round, so the values are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.fused import kernels_for


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] laid out [gate | up] -> [..., I]."""
    kernels = kernels_for(gate_up)
    if kernels is not None:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(
    h: torch.Tensor,
    limit: float,
    alpha: float,
    bias: torch.Tensor | None = None,
    bias_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """gpt-oss's SwiGLU over interleaved gate/up columns h [T, 2I] -> [T, I]:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit).

    With `bias` [E, 2I] and `bias_rows` [T] (each row's expert), h + bias[bias_rows] first.
    """
    if (bias is None) != (bias_rows is None):
        raise ValueError("clamped_swiglu: bias and bias_rows go together (both or neither)")
    kernels = kernels_for(h)
    if kernels is not None:
        return kernels.clamped_swiglu(h, limit, alpha, bias, bias_rows)
    if bias is not None:
        h = h + bias[bias_rows]
    gate = h[:, ::2].clamp(max=limit)
    up = h[:, 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
