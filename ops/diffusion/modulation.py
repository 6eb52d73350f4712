"""modulate: adaLN scale/shift, `x * (1 + scale) + shift`.

Every DiT block conditions its normalised activations on the timestep this way (adaLN, adaLN-Zero,
adaLN-single). One `addcmul` in fp32 rounds once instead of three times in bf16, and the per-sample
[B, D] form that Flux/SD3 use is accepted directly so callers do not unsqueeze.
"""

from __future__ import annotations

import torch


def broadcast_modulation(x: torch.Tensor, name: str, value: torch.Tensor) -> torch.Tensor:
    """Shape `value` against x [B, N, D]: a 2-D value is [B, D] (per sample), else it must broadcast."""
    given = value.shape
    if value.dim() == 2 and x.dim() == 3:
        value = value[:, None, :]  # [B, D] -> [B, 1, D]
    # Plain loop: torch.broadcast_shapes costs ~40 us per call, more than the op itself.
    shape, target = value.shape, x.shape
    fits = len(shape) <= len(target)
    for offset in range(1, len(shape) + 1) if fits else ():
        if shape[-offset] != 1 and shape[-offset] != target[-offset]:
            fits = False
            break
    if not fits:
        raise ValueError(
            f"modulate: {name} has shape {tuple(given)}, which does not broadcast to x "
            f"{tuple(x.shape)}; allowed: [B, D] per sample or a 1-D/3-D shape broadcastable to x"
        )
    return value


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * (1 + scale) + shift in fp32, rounded once to x's dtype.

    x [B, N, D]; shift, scale [B, D] (one row per sample) or broadcastable to x ([B, 1, D], [D]).
    Returns [B, N, D] in x's dtype.
    """
    shift = broadcast_modulation(x, "shift", shift)
    scale = broadcast_modulation(x, "scale", scale)
    out = torch.addcmul(shift.float(), x.float(), 1.0 + scale.float())  # [B, N, D] fp32
    return out.to(x.dtype)
