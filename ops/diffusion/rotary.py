"""dit_rope: rotary position embedding with precomputed per-position cos/sin tables.

DiT models (Flux, CogVideoX, HunyuanDiT, SD3.5-style multi-axis rope) build cos/sin [S, D] once per
forward from 2-D/3-D position ids, so the op takes the tables rather than a base frequency. Pairs
are either interleaved (x[2i], x[2i+1]; Flux) or split in halves (x[i], x[i + D/2]; CogView4).
Math in fp32, rounded once to x's dtype, as diffusers' `apply_rotary_emb` does.
"""

from __future__ import annotations

import torch

SEQUENCE_DIMS = (1, 2)


def check_rope_args(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int
) -> None:
    """Reject tables or layouts that do not fit x, naming the bad field."""
    if x.dim() != 4:
        raise ValueError(
            f"dit_rope: x must be 4-D ([B, H, S, D] or [B, S, H, D]); got {tuple(x.shape)}"
        )
    if sequence_dim not in SEQUENCE_DIMS:
        raise ValueError(
            f"dit_rope: sequence_dim={sequence_dim!r}; allowed values: 1 ([B, S, H, D]), 2 ([B, H, S, D])"
        )
    if x.shape[-1] % 2:
        raise ValueError(f"dit_rope: x's head dim must be even; got {x.shape[-1]}")
    expected = (x.shape[sequence_dim], x.shape[-1])
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != expected:
            raise ValueError(
                f"dit_rope: {name} must have shape [S, D] = {list(expected)}; got {tuple(table.shape)}"
            )


def dit_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    is_interleaved: bool = True,
    sequence_dim: int = 2,
) -> torch.Tensor:
    """Rotate x by the angles whose cos/sin are given, per position and channel.

    x [B, H, S, D] (sequence_dim=2) or [B, S, H, D] (sequence_dim=1); cos, sin [S, D] with each
    angle repeated for both members of its pair. Returns x's shape and dtype.
    """
    check_rope_args(x, cos, sin, sequence_dim)
    cos32, sin32 = cos.float(), sin.float()
    if sequence_dim == 1:
        cos32, sin32 = cos32[:, None, :], sin32[:, None, :]  # [S, 1, D] against [B, S, H, D]
    x32 = x.float()
    if is_interleaved:
        pairs = x32.unflatten(-1, (-1, 2))  # [..., D/2, 2]
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        first, second = x32.chunk(2, dim=-1)  # [..., D/2] each
        rotated = torch.cat((-second, first), dim=-1)
    return (x32 * cos32 + rotated * sin32).to(x.dtype)
