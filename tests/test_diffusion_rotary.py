"""dit_rope against diffusers' apply_rotary_emb and an independent complex-number reference."""

from __future__ import annotations

import pytest
import torch

from ops.diffusion import dit_rope


def _tables(seq_len: int, head_dim: int, generator):
    angles = torch.rand(seq_len, head_dim // 2, generator=generator, dtype=torch.float64) * 6.0
    return angles  # [S, D/2]


def _complex_reference(x, angles, is_interleaved, sequence_dim):
    """Rotate each channel pair as a complex number by e^{i angle}, in float64."""
    x64 = x.double()
    if sequence_dim == 1:
        x64 = x64.transpose(1, 2)  # -> [B, H, S, D]
    if is_interleaved:
        pairs = torch.complex(x64[..., 0::2], x64[..., 1::2])
    else:
        half = x64.shape[-1] // 2
        pairs = torch.complex(x64[..., :half], x64[..., half:])
    rotated = pairs * torch.polar(torch.ones_like(angles), angles)
    if is_interleaved:
        out = torch.stack((rotated.real, rotated.imag), dim=-1).flatten(-2)
    else:
        out = torch.cat((rotated.real, rotated.imag), dim=-1)
    return out.transpose(1, 2) if sequence_dim == 1 else out


def _cos_sin(angles, is_interleaved):
    if is_interleaved:
        full = angles.repeat_interleave(2, dim=-1)  # [S, D]: (a0, a0, a1, a1, ...)
    else:
        full = torch.cat((angles, angles), dim=-1)  # [S, D]: (a0, a1, ..., a0, a1, ...)
    return full.cos().float(), full.sin().float()


@pytest.mark.parametrize("is_interleaved", [True, False])
@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_dit_rope_matches_complex_rotation(is_interleaved, sequence_dim):
    generator = torch.Generator().manual_seed(0)
    shape = (2, 3, 7, 16) if sequence_dim == 2 else (2, 7, 3, 16)
    x = torch.randn(shape, generator=generator)
    angles = _tables(7, 16, generator)
    cos, sin = _cos_sin(angles, is_interleaved)
    out = dit_rope(x, cos, sin, is_interleaved=is_interleaved, sequence_dim=sequence_dim)
    expected = _complex_reference(x, angles, is_interleaved, sequence_dim)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("is_interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dit_rope_equals_diffusers_apply_rotary_emb(is_interleaved, dtype):
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 4, 32, generator=generator).to(dtype)  # [B, S, H, D] as Flux passes it
    cos, sin = _cos_sin(_tables(9, 32, generator), is_interleaved)
    expected = embeddings.apply_rotary_emb(
        x,
        (cos, sin),
        use_real=True,
        use_real_unbind_dim=-1 if is_interleaved else -2,
        sequence_dim=1,
    )
    out = dit_rope(x, cos, sin, is_interleaved=is_interleaved, sequence_dim=1)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sequence_dim": 3}, r"sequence_dim=3; allowed values: 1"),
        ({"cos": torch.ones(5, 8)}, r"cos must have shape \[S, D\] = \[6, 8\]"),
        ({"sin": torch.ones(6, 4)}, r"sin must have shape \[S, D\] = \[6, 8\]"),
        ({"x": torch.ones(2, 6, 8)}, r"x must be 4-D"),
    ],
)
def test_bad_rope_arguments_name_the_field(kwargs, message):
    args = {"x": torch.ones(1, 2, 6, 8), "cos": torch.ones(6, 8), "sin": torch.ones(6, 8)} | kwargs
    with pytest.raises(ValueError, match=message):
        dit_rope(**args)
