"""CUDA quantized linears on the H200 (`pytest -m gpu`): fp8 through `_scaled_mm` with per-token
activation scales, int8 / int4 through torch's `_weight_int8pack_mm` / `_weight_int4pack_mm`.

Oracles: for fp8, the same quantization done in plain torch ops and multiplied in fp32
((x_q * s_x) @ (w_q * s_w).T), so only the bf16 output rounding and the sum order differ; for the
models, the dequantised (or fake-quantised) weights in a dense model, within the activation
quantization's error. Skipped without a GPU of compute capability 8.9+ (fp8) / 8.0+ (int4).
"""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import write_fp8_checkpoint
from tiny_models import VOCAB_SIZE

import models
import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


CALM = 0.05  # the tiny llama's 0.2 init amplifies any rounding ~10x over its 3 layers


def needs_fp8():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmuls need compute capability 8.9+")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_row_quantization_kernel_equals_the_torch_reference():
    needs_fp8()
    from ops.quant.fp8_triton import quantize_rows, quantize_rows_reference

    for m, k in ((1, 2048), (7, 4096), (64, 14336), (3, 80)):
        x = (torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 4).bfloat16()
        q, s = quantize_rows(x)
        q_ref, s_ref = quantize_rows_reference(x)
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
        # the kernel's fp32 divide may round differently: at most one e4m3 step (2^-3 relative)
        torch.testing.assert_close(q.float(), q_ref.float(), rtol=0.13, atol=2**-9)
        assert (q.float() == q_ref.float()).float().mean() > 0.99


@pytest.mark.parametrize("m", [1, 5, 64])
def test_scaled_mm_linear_equals_the_quantized_product_in_fp32(monkeypatch, m):
    needs_fp8()
    from ops.quant import fp8
    from ops.quant.fp8 import quantize_fp8
    from ops.quant.fp8_triton import quantize_rows_reference

    monkeypatch.setattr(fp8, "WEIGHT_ONLY_MAX_ROWS", 0)  # every M through _scaled_mm

    w = torch.randn(1024, 2048, device="cuda").bfloat16() * 0.02
    x = torch.randn(m, 2048, device="cuda").bfloat16()
    packed = quantize_fp8(w)
    assert packed.uses_scaled_mm
    got = ops.linear(x, packed)
    xq, sx = quantize_rows_reference(x)
    want = (xq.float() * sx) @ (packed.weight.float() * packed.scale[:, None]).T
    assert got.dtype == torch.bfloat16 and got.shape == (m, 1024)
    assert rel_err(got, want) < 4e-3  # bf16 output rounding
    assert rel_err(got, x.float() @ w.float().T) < 6e-2  # the e4m3 rounding of both operands


@pytest.mark.parametrize("m", [1, 3, 8])
def test_weight_only_fp8_kernel_equals_the_dequantised_matmul(monkeypatch, m):
    needs_fp8()
    from ops.quant import fp8
    from ops.quant.gemv_tiles import MAX_ROWS

    w = torch.randn(3072, 2048, device="cuda").bfloat16() * 0.02
    x = torch.randn(m, 2048, device="cuda").bfloat16()
    packed = fp8.quantize_fp8(w)
    monkeypatch.setattr(fp8, "WEIGHT_ONLY_MAX_ROWS", MAX_ROWS)
    got = ops.linear(x, packed)
    want = x.float() @ (packed.weight.float() * packed.scale[:, None]).T
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 4e-3


@torch.no_grad()
@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_fp8_checkpoint_on_cuda_is_close_to_its_dequantised_weights(tmp_path, layout):
    needs_fp8()
    fp8_dir, dense_dir = write_fp8_checkpoint(tmp_path, layout, initializer_range=CALM)
    loaded = models.load_model(fp8_dir, device="cuda", dtype="bfloat16")
    qkv = loaded.model.model.layers[0].self_attn.qkv_weight
    assert qkv.uses_scaled_mm == (layout != "block")  # block scales: the reference path
    oracle = models.load_model(dense_dir, device="cuda", dtype="bfloat16")
    tokens = torch.randint(3, VOCAB_SIZE, (1, 24), device="cuda")
    pos = torch.arange(24, device="cuda")[None]
    got = loaded.model.compute_logits(loaded.model(tokens, pos, None))
    want = oracle.model.compute_logits(oracle.model(tokens, pos, None))
    assert rel_err(got, want) < (1e-2 if layout == "block" else 8e-2)


def test_fp8_engine_with_cuda_graphs_equals_eager(tmp_path):
    needs_fp8()
    from torch_runner import Engine, SamplingParams

    fp8_dir, _ = write_fp8_checkpoint(tmp_path, "channel")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(20, 50)), [9] * 11]
    outs = []
    for eager in (True, False):
        engine = Engine(str(fp8_dir), device="cuda", dtype="bfloat16", max_total_tokens=1024,
                        enforce_eager=eager, cuda_graph_max_bs=4)  # fmt: skip
        outs.append([o.token_ids for o in engine.generate(prompts, params)])
        assert (engine.runner.decode_graphs is None) == eager
    assert outs[0] == outs[1]


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_int_linear_on_cuda_equals_the_dequantised_matmul(mode, m):
    from ops.quant.int_linear import dequantize_int4, quantize_int4, quantize_int8

    w = torch.randn(1024, 2048, device="cuda").bfloat16() * 0.02
    x = torch.randn(m, 2048, device="cuda").bfloat16()
    if mode == "int8":
        packed = quantize_int8(w)
        dense = packed.qweight.float() * packed.scales.float()[:, None]
    else:
        packed = quantize_int4(w, 32, keep_codes=True)
        dense = dequantize_int4(packed.codes, packed.scales_and_zeros, 32)
    got = ops.linear(x, packed)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 1024)
    assert rel_err(got, x.float() @ dense.T) < 1e-2


def dequantized(weight) -> torch.Tensor:
    """The dense [N, K] weight a quantized weight stands for; int4 keeps no codes on CUDA, so its
    kernel is applied to the identity (each output is one weight times 1: its dequantised value)."""
    if hasattr(weight, "dequantize"):
        return weight.dequantize()
    eye = torch.eye(weight.shape[1], dtype=weight.dtype, device=weight.device)
    return weight.matmul(eye).T.contiguous()


@torch.no_grad()
@pytest.mark.parametrize("mode", ["fp8", "int8", "int4"])
def test_quantized_model_on_cuda_equals_its_dequantised_weights_and_graphs_equal_eager(
    tmp_path, mode
):
    """--quantization on CUDA: every dense linear and the lm_head replaced; logits near a dense
    bf16 model holding each replaced weight dequantised (kernel rounding, and for fp8 batches
    past WEIGHT_ONLY_MAX_ROWS the activation quantization); CUDA-graph decode equal to eager."""
    if mode == "fp8":
        needs_fp8()
    from ops.quant.fp8 import Fp8Weight
    from ops.quant.int_linear import Int4Weight, Int8Weight
    from torch_runner import Engine, SamplingParams

    _, dense_dir = write_fp8_checkpoint(tmp_path, "channel", initializer_range=CALM)
    loaded = models.load_model(dense_dir, device="cuda", dtype="bfloat16", quantization=mode)
    ref = models.load_model(dense_dir, device="cuda", dtype="bfloat16")
    kind = {"fp8": Fp8Weight, "int8": Int8Weight, "int4": Int4Weight}[mode]
    replaced = 0
    for q_mod, r_mod in zip(loaded.model.modules(), ref.model.modules()):
        for attr in ("qkv_weight", "gate_up_weight", "weight"):
            value = vars(q_mod).get(attr)
            if isinstance(value, kind):
                replaced += 1
                getattr(r_mod, attr).copy_(dequantized(value))
    assert replaced == 3 * 4 + 1  # qkv, o, gate_up, down per layer, and the lm_head
    tokens = torch.randint(3, VOCAB_SIZE, (1, 24), device="cuda")
    pos = torch.arange(24, device="cuda")[None]
    got = loaded.model.compute_logits(loaded.model(tokens, pos, None))
    want = ref.model.compute_logits(ref.model(tokens, pos, None))
    assert torch.isfinite(got).all() and rel_err(got, want) < (6e-2 if mode == "fp8" else 1e-2)
    one = loaded.model.compute_logits(loaded.model(tokens[:, :1], pos[:, :1], None))
    ref_one = ref.model.compute_logits(ref.model(tokens[:, :1], pos[:, :1], None))
    # one row: fp8's weight-only kernel, no activation rounding (H200: fp8 0.0104)
    assert rel_err(one, ref_one) < 2e-2
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(20, 50))]
    outs = []
    for eager in (True, False):
        engine = Engine(str(dense_dir), device="cuda", dtype="bfloat16", quantization=mode,
                        max_total_tokens=1024, enforce_eager=eager, cuda_graph_max_bs=4)  # fmt: skip
        outs.append([o.token_ids for o in engine.generate(prompts, params)])
    assert outs[0] == outs[1]
