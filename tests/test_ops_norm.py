"""ops.norm: fp32 accumulation, optional weight/bias, output in the input dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

from ops.norm import layer_norm, rms_norm


def _x(dtype, shape=(3, 5, 96)):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3 + 1).to(dtype)


def _rms_reference(x, weight, eps):
    x64 = x.double()
    out = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("has_weight", [False, True])
def test_rms_norm_matches_float64_reference_rounded_once(dtype, has_weight):
    x = _x(dtype)
    weight = torch.rand(96).to(dtype) + 0.5 if has_weight else None
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    want = _rms_reference(x, weight, 1e-6)
    # no worse than one rounding of the exact result into the output dtype
    budget = (want.to(dtype).double() - want).abs().max().item()
    assert (out.double() - want).abs().max().item() <= max(budget, 1e-6)


def test_rms_norm_equals_gpt_oss_rmsnorm_module():
    module = GptOssRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(torch.rand(96) + 0.5)
    x = _x(torch.float32)
    torch.testing.assert_close(rms_norm(x, module.weight.detach(), 1e-5), module(x).detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_layer_norm_matches_float64_reference(dtype, affine):
    x = _x(dtype)
    weight = torch.rand(96) + 0.5 if affine != "none" else None
    bias = torch.randn(96) if affine == "both" else None
    out = layer_norm(x, weight, bias, 1e-5)
    assert out.dtype == dtype
    x64 = x.double()
    want = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(
        x64.var(-1, unbiased=False, keepdim=True) + 1e-5
    )
    if weight is not None:
        want = want * weight.double()
    if bias is not None:
        want = want + bias.double()
    budget = (want.to(dtype).double() - want).abs().max().item()
    assert (out.double() - want).abs().max().item() <= max(budget, 1e-5)


def test_norms_reject_a_weight_of_the_wrong_size():
    x = _x(torch.float32)
    with pytest.raises(ValueError, match=r"rms_norm: weight must be \[96\]"):
        rms_norm(x, torch.ones(95), 1e-6)
    with pytest.raises(ValueError, match=r"layer_norm: bias must be \[96\]"):
        layer_norm(x, None, torch.ones(3), 1e-6)


@pytest.mark.parametrize("shape", [(1, 1, 576), (64, 1, 576), (3, 17, 96), (2, 4096), (5, 1, 2880)])
def test_fp32_cpu_rms_norm_is_llama_rmsnorm_bit_for_bit(shape):
    """The CPU fp32 path (its own six ops) against transformers' LlamaRMSNorm and F.rms_norm."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1])) * 3
    module = LlamaRMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(torch.rand(shape[-1]) + 0.5)
    weight = module.weight.detach()
    assert torch.equal(rms_norm(x, weight, 1e-5), module(x).detach())
    assert torch.equal(rms_norm(x, weight, 1e-5), F.rms_norm(x, shape[-1:], weight, 1e-5))
    assert torch.equal(rms_norm(x, None, 1e-6), F.rms_norm(x, shape[-1:], None, 1e-6))
