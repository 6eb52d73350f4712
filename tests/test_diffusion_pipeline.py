"""A whole diffusers pipeline (tiny Flux: transformer, VAE, flow-match scheduler) runs patched.

Oracle: the same pipeline, same seed, unpatched. The patched run must give the same latents and
images within the contract's bounds, and unpatching must give back the exact unpatched images.
"""

from __future__ import annotations

import pytest
import torch

from ops.diffusion import patch, unpatch
from ops.diffusion.tiny import tiny_flux_pipeline, tiny_flux_prompt

pytest.importorskip("diffusers")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _generate(pipe, prompt, output_type):
    out = pipe(
        **prompt,
        height=16,
        width=16,
        num_inference_steps=3,
        guidance_scale=3.5,
        output_type=output_type,
        generator=torch.Generator().manual_seed(0),
    )
    return out.images


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_patched_pipeline_generates_the_same_latents_and_images(dtype):
    pipe = tiny_flux_pipeline(num_layers=1, num_single_layers=1).to(dtype)
    prompt = tiny_flux_prompt(pipe)
    latents = _generate(pipe, prompt, "latent")
    images = _generate(pipe, prompt, "pt")
    assert latents.abs().max() > 0.1

    report = patch(pipe.transformer, backend="torch")
    assert len(report.replaced) == 12
    torch.testing.assert_close(
        _generate(pipe, prompt, "latent"), latents, atol=TOLERANCE[dtype], rtol=0
    )
    torch.testing.assert_close(_generate(pipe, prompt, "pt"), images, atol=TOLERANCE[dtype], rtol=0)

    unpatch(pipe.transformer)
    assert torch.equal(_generate(pipe, prompt, "pt"), images)
