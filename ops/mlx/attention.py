"""MLX attention with ops.attention's signature: mx.fast.scaled_dot_product_attention.

The visibility rules and the mask cache are shared with the torch op (the mask is a torch
tensor built once per step and borrowed into MLX). MLX's "causal" string mask is lower-right
aligned, so a causal tail (prefill chunk after a cached prefix) needs no mask tensor at all;
sinks go to SDPA's native `sinks=` argument.
"""

from __future__ import annotations

import mlx.core as mx
import torch

from bridge import mlx_call
from ops.attention import KeyLayout, check_attention_args, tail_mask


def sdpa_mx(q, k, v, mask=None, sinks=None, *, scale: float):
    """q [B, Hq, N, D], k/v [B, Hkv, S, D] mx arrays; mask None | "causal" | bool array."""
    if sinks is not None:
        sinks = sinks.astype(q.dtype)  # MLX requires sinks to promote to the output dtype
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def mask_for(q_positions, layout: KeyLayout | None, n: int, num_keys: int, window: int | None):
    """None, "causal" (lower-right) or a torch bool mask, for MLX SDPA."""
    if layout is None or layout.is_causal_tail:
        if window is None or num_keys <= window:
            return None if n == 1 else "causal"
        if layout is None:
            return tail_mask(n, n, window, q_positions.device)
    return layout.mask(q_positions, num_keys, window)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    layout: KeyLayout | None,
    *,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Same contract as ops.attention.attention; one MLX crossing."""
    check_attention_args(q, k, v, q_positions, layout, window, sinks)
    mask = mask_for(q_positions, layout, q.shape[2], k.shape[2], window)
    return mlx_call(sdpa_mx, q, k, v, mask, sinks, scale=sm_scale)
