"""modulate: adaLN scale/shift against a float64 reference, in every shape DiT blocks pass."""

from __future__ import annotations

import pytest
import torch

from ops.diffusion import modulate


def _reference64(x, shift, scale):
    return x.double() * (1 + scale.double()) + shift.double()


@pytest.mark.parametrize(
    "param_shape",
    [(2, 16), (2, 1, 16), (16,), (2, 5, 16)],
    ids=["per-sample [B, D]", "[B, 1, D]", "[D]", "per-token"],
)
def test_modulate_matches_reference_for_each_shape(param_shape):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=generator)
    shift = torch.randn(param_shape, generator=generator)
    scale = torch.randn(param_shape, generator=generator)
    out = modulate(x, shift, scale)
    expanded = [p[:, None, :] if p.dim() == 2 else p for p in (shift, scale)]
    torch.testing.assert_close(out.double(), _reference64(x, *expanded), atol=1e-6, rtol=1e-6)


def test_bf16_modulate_rounds_once():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, 256, generator=generator).bfloat16()
    shift = torch.randn(4, 256, generator=generator).bfloat16()
    scale = torch.randn(4, 256, generator=generator).bfloat16()
    out = modulate(x, shift, scale)
    assert out.dtype == torch.bfloat16
    reference = _reference64(x, shift[:, None], scale[:, None])
    err = (out.double() - reference).abs().max().item()
    once = (reference.float().bfloat16().double() - reference).abs().max().item()
    three_roundings = x * (1 + scale[:, None]) + shift[:, None]  # diffusers' bf16 arithmetic
    assert err <= once * (1 + 1e-3), (err, once)
    assert err < (three_roundings.double() - reference).abs().max().item()


@pytest.mark.parametrize("field", ["shift", "scale"])
def test_unbroadcastable_modulation_names_the_field(field):
    x = torch.randn(2, 5, 16)
    good, bad = torch.zeros(2, 16), torch.zeros(3, 16)
    args = {"shift": good, "scale": good, field: bad}
    with pytest.raises(ValueError, match=rf"modulate: {field} has shape \(3, 16\)"):
        modulate(x, **args)
