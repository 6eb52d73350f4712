"""Weight-only int8 / int4 linears (ops/quant/int_linear.py) and `quantization=` at load.

Oracles: the quantised weights dequantised with plain torch ops (q * s; (q - 8) * scale + zero)
and multiplied densely; for whole models, transformers' model with every linear replaced by
that fake-quantised weight (rows quantise independently, so fusing q/k/v first changes nothing).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import byte_tokenizer, hf_greedy
from tiny_models import VOCAB_SIZE, build_tiny_model

import models
import ops
from ops.quant.int_linear import (
    Int8Weight,
    dequantize_int4,
    int4_codes,
    quantize_int4,
    quantize_int8,
    quantize_weight,
)

pytestmark = pytest.mark.usefixtures("one_thread", "torch_cpu_kernels")  # torch formats


def weight(n=96, k=128, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int8_rounds_each_weight_to_its_channel_grid():
    w = weight()
    packed = quantize_int8(w)
    step = packed.scales[:, None]
    assert packed.qweight.dtype == torch.int8
    assert ((packed.dequantize() - w).abs() <= step / 2 + 1e-7).all()


def test_int4_rounds_each_weight_to_its_group_grid():
    w = weight()
    codes, scales, zeros = int4_codes(w, 32)
    assert codes.min() >= 0 and codes.max() <= 15
    sz = torch.stack([scales, zeros], -1).transpose(0, 1)
    err = (dequantize_int4(codes, sz, 32) - w).abs().reshape(96, 4, 32)
    assert (err <= scales[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_equals_dequantised_matmul(mode, dtype):
    w = weight().to(dtype)
    x = torch.randn(2, 3, 128).to(dtype)  # [B, N, K]: ops.linear flattens the leading dims
    bias = torch.randn(96).to(dtype)
    residual = torch.randn(2, 3, 96).to(dtype)
    if mode == "int8":
        packed = quantize_int8(w)
        dense = packed.qweight.float() * packed.scales.float()[:, None]
    else:
        packed = quantize_int4(w, 32, keep_codes=True)
        dense = dequantize_int4(packed.codes, packed.scales_and_zeros, 32)
    want = x.float() @ dense.T + bias.float()
    got = ops.linear(x, packed, bias)
    assert got.dtype == dtype and got.shape == (2, 3, 96)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(
        ops.linear_add(x, packed, bias, residual).float(), want + residual.float(), **tol
    )


def test_unknown_quantization_and_bad_int4_shapes_are_errors_naming_them():
    with pytest.raises(ValueError, match="quantization='int3'.*int8, int4"):
        quantize_weight(weight(), "int3")
    with pytest.raises(ValueError, match=r"\[96, 100\] weight"):
        quantize_int4(weight(96, 100), 32)
    with pytest.raises(ValueError, match="group_size=48"):
        quantize_int4(weight(), 48)


def fake_quantize(w: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "int8":
        packed = quantize_int8(w)
        return packed.qweight.float() * packed.scales.float()[:, None]
    codes, scales, zeros = int4_codes(w, 32)
    return dequantize_int4(codes, torch.stack([scales, zeros], -1).transpose(0, 1), 32)


@torch.no_grad()
def fake_quantized_reference(mode: str, **overrides):
    """transformers' tiny llama with every decoder linear and the lm_head fake-quantised."""
    hf = build_tiny_model("llama", tie_word_embeddings=False, **overrides)
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and (".layers." in name or name == "lm_head"):
            module.weight.copy_(fake_quantize(module.weight, mode))
    return hf


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_untied")
    build_tiny_model("llama", tie_word_embeddings=False).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_bf16_compute_of_fp32_activations_equals_the_bf16_rounded_matmul(mode):
    w = weight()
    x = torch.randn(2, 3, 128)
    if mode == "int8":
        packed = quantize_int8(w)
        dense = packed.qweight.float() * packed.scales.bfloat16().float()[:, None]
    else:
        packed = quantize_int4(w, 32, keep_codes=True)
        sz = packed.scales_and_zeros.bfloat16()
        dense = dequantize_int4(packed.codes, sz, 32)
    packed.set_compute_dtype(torch.bfloat16)
    want = x.bfloat16().float() @ dense.T  # the input rounded to bf16, fp32 products
    got = ops.linear(x, packed)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 96)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # the kernel's bf16 output
    exact = x @ dense.T
    assert not torch.equal(got, exact)  # the rounding is real, not a no-op


def test_fp32_models_compute_quantized_linears_in_bf16_on_cpu(llama_folder):
    loaded = models.load_model(llama_folder, device="cpu", dtype="float32", quantization="int8")
    want = torch.bfloat16
    assert loaded.model.model.layers[0].self_attn.qkv_weight.compute_dtype == want
    assert loaded.model.lm_head.weight.compute_dtype == want
    bf16 = models.load_model(llama_folder, device="cpu", dtype="bfloat16", quantization="int4")
    assert bf16.model.model.layers[0].mlp.gate_up_weight.compute_dtype == torch.bfloat16


@torch.no_grad()
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_logits_equal_the_fake_quantised_reference(llama_folder, mode, exact_fp32):
    loaded = models.load_model(llama_folder, device="cpu", dtype="float32", quantization=mode)
    layer = loaded.model.model.layers[0]
    assert layer.self_attn.qkv_weight.is_quantized and loaded.model.lm_head.weight.is_quantized
    ids = torch.randint(3, VOCAB_SIZE, (1, 40), generator=torch.Generator().manual_seed(1))
    got = loaded.model.compute_logits(loaded.model(ids, torch.arange(40)[None], None))
    want = fake_quantized_reference(mode)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_engine_greedy_with_quantized_linears_equals_the_reference(llama_folder, mode, exact_fp32):
    from torch_runner import Engine, SamplingParams

    engine = Engine(
        str(llama_folder), device="cpu", dtype="float32", quantization=mode, max_total_tokens=512
    )
    hf = fake_quantized_reference(mode)
    prompts = [[5, 6, 7], list(range(20, 50))]
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)


def test_tied_model_gets_a_quantized_head_and_keeps_a_dense_embedding(tmp_path):
    build_tiny_model("llama").save_pretrained(tmp_path)  # tie_word_embeddings=True
    loaded = models.load_model(tmp_path, device="cpu", dtype="float32", quantization="int8")
    assert isinstance(loaded.model.lm_head.weight, Int8Weight)
    assert loaded.model.model.embed_tokens.weight.dtype == torch.float32


def test_unknown_quantization_is_a_load_error_listing_the_allowed(llama_folder):
    with pytest.raises(models.ModelLoadError, match="quantization='fp3'.*none, int8, int4"):
        models.load_model(llama_folder, device="cpu", quantization="fp3")


@pytest.mark.parametrize(("field", "value"), [("quantization", "int2"), ("moe_weights", "fp8")])
def test_engine_config_rejects_unknown_values_naming_the_field(field, value):
    from torch_runner.config import EngineConfig

    with pytest.raises(ValueError, match=f"{field}='{value}' is invalid; allowed values"):
        EngineConfig(**{field: value})
