"""MLX rotary embedding with ops.rope.apply_rope's signature.

Explicit cos/sin rather than mx.fast.rope: mx.fast.rope takes one offset per row and assumes
consecutive positions, while our positions [B, N] are arbitrary (batched decode rows, chunks
after a prefix), and it has no cos/sin scale for YaRN's attention_scaling.
"""

from __future__ import annotations

import mlx.core as mx
import torch

from bridge import mlx_call_multi
from ops.rope import check_rope_positions


def rope_cos_sin_mx(positions, inv_freq, attention_scaling: float, dtype):
    """cos, sin [B, 1, N, D_rot / 2] for positions [B, N] (the half that rotate_half repeats)."""
    freqs = positions[..., None].astype(mx.float32) * inv_freq.astype(mx.float32)  # [B, N, D/2]
    cos = (mx.cos(freqs) * attention_scaling).astype(dtype)[:, None]
    sin = (mx.sin(freqs) * attention_scaling).astype(dtype)[:, None]
    return cos, sin


def rotate_mx(x, cos, sin):
    """HF rotate_half on the first 2 * cos.shape[-1] dims of x [B, H, N, D]."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * half < x.shape[-1]:
        parts.append(x[..., 2 * half :])
    return mx.concatenate(parts, axis=-1)


def apply_rope_mx(q, k, positions, inv_freq, attention_scaling: float):
    cos, sin = rope_cos_sin_mx(positions, inv_freq, attention_scaling, q.dtype)
    return rotate_mx(q, cos, sin), rotate_mx(k, cos, sin)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ops.rope.apply_rope; one MLX crossing for both outputs."""
    check_rope_positions(q, positions)
    return mlx_call_multi(apply_rope_mx, q, k, positions, inv_freq, attention_scaling)
