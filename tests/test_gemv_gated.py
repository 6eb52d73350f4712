"""The gate/up projection with SiLU-mul in the GEMV's epilogue (`ops.linear_silu_mul`, the
GEMV's gated mode in ops/quant/gemv_triton.py): the values of the GEMV followed by the SiLU-mul
kernel, bit for bit, for fp8 / int8 / bf16 weights, the FMA and tensor-core loops, split-K, block
scales, a bias; on CPU through Triton's interpreter (skipped where triton is not installed, as in
CI), on CUDA for real (`pytest -m gpu`); off CUDA `linear_silu_mul` is the torch composition.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from gemv_weights import random_weight
from triton_interpreter import assert_interpreter_ok

import ops

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

# (M, 2I, K, tile, tensor-core loop): ragged I and K, split-K, a one-channel tile (widened to a
# gate / up pair), the table's tile (None), one and several rows
GATED_CASES = [(1, 40, 256, (8, 64, 2, 1), False), (3, 24, 192, (4, 64, 1, 2), False),
               (1, 64, 256, (16, 64, 1, 1), True), (2, 32, 256, (16, 64, 1, 2), True),
               (1, 20, 100, (4, 32, 1, 1), False), (1, 36, 128, (1, 64, 1, 1), False),
               (5, 44, 96, None, False)]  # fmt: skip

INTERPRETER_CHECK = """
import torch
from test_gemv_gated import GATED_CASES, gated_case
from test_ops_quant_gemv import block_case
from ops.fused.triton_kernels import silu_mul
from ops.quant.gemv_triton import _workspaces, gemv
for i, (m, n, k, cfg, dot) in enumerate(GATED_CASES):
    for kind in ("fp8", "bf16", "int8"):
        if kind == "int8" and dot:
            continue
        x, w, s, bias = gated_case(m, n, k, kind, seed=i)
        want = silu_mul(gemv(x, w, s, cfg, dot=dot, bias=bias))  # the GEMV, then the SiLU-mul kernel
        got = gemv(x, w, s, cfg, dot=dot, bias=bias, gated=True)
        assert got.shape == (m, n // 2), got.shape
        assert torch.equal(got, want), (i, kind, (got.float() - want.float()).abs().max())
        if kind == "fp8" and m == 1 and not dot:  # e4m3 by bit placement
            want = silu_mul(gemv(x, w, s, cfg, bits=True))
            assert torch.equal(gemv(x, w, s, cfg, bits=True, gated=True), want)
assert not _workspaces[torch.device("cpu")][1].any()  # the split calls reset their counters
m, n, k, block, cfg = 3, 64, 512, (32, 64), (8, 512, 4, 1)  # block scales
x, w, s, _ = block_case(m, n, k, block, seed=1)
assert torch.equal(gemv(x, w, s, cfg, block=block, gated=True), silu_mul(gemv(x, w, s, cfg, block=block)))
try:
    gemv(x, w[:-1], s, cfg, gated=True)
    raise SystemExit("an odd row count passed")
except ValueError as e:
    assert "even" in str(e), e
print("ok")
"""


def gated_case(m: int, n: int, k: int, kind: str, seed: int, device="cpu"):
    """x [m, k] bf16 and a [gate | up] weight [n, k]: e4m3 / int8 with a per-channel scale, or
    bf16 (with a bias) and no scale; sums spread over SiLU's curve."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16().to(device)
    w, scale = random_weight(n, k, kind, gen)
    if kind == "bf16":
        bias = torch.randn(n, generator=gen).bfloat16().to(device)
        return x, w.to(device), None, bias
    return x, w.to(device), scale.to(device), None


@pytest.mark.skipif(
    HAS_CUDA or not HAS_TRITON, reason="CPU interpreter check (with CUDA the kernel runs for real)"
)
def test_gated_gemv_equals_the_gemv_then_silu_mul_in_the_interpreter():
    assert_interpreter_ok(INTERPRETER_CHECK)


def test_auto_fuses_the_measured_shapes():
    from ops.quant import gemv_tiles

    takes = gemv_tiles.silu_in_gemv
    assert takes("fp8", 1, 28672, 4096, "auto") and not takes("bf16", 1, 28672, 4096, "auto")
    assert not takes("fp8", 2, 28672, 4096, "auto") and takes("bf16", 2, 28672, 4096, "on")
    assert not takes("fp8", 1, 28672, 4096, "off")
    # more rows than the GEMV takes (a prefill chunk, batch 9+): never, not an error
    assert not takes("fp8", 9, 28672, 4096, "auto") and not takes("bf16", 300, 64, 32, "on")


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_prefill_rows_of_a_fused_shape_run_the_matmul_then_silu_mul(mode, monkeypatch):
    """A quantized gate/up product of more rows than the GEMV takes (here 9 and 33, as a prefill
    chunk gives) skips the gated GEMV and returns linear then SiLU-mul, where the shape table
    would fuse its decode rows (the 12-06 fp8 prefill raised in block_rows)."""
    from ops.activation import silu_mul
    from ops.quant import gemv_tiles
    from ops.quant.int_linear import quantize_int8

    linear_module = importlib.import_module("ops.linear")
    monkeypatch.setattr(linear_module, "_SILU_MODE", [mode])
    monkeypatch.setattr(linear_module, "kernels_for", lambda x: object())  # as on CUDA
    monkeypatch.setattr(gemv_tiles, "SILU_FASTER", {("int8", 8, 16, 32)})
    gen = torch.Generator().manual_seed(1)
    weight = quantize_int8(torch.randn(16, 32, generator=gen).bfloat16())
    for rows in (9, 33):
        x = torch.randn(rows, 32, generator=gen).bfloat16()
        assert torch.equal(ops.linear_silu_mul(x, weight), silu_mul(ops.linear(x, weight)))


def test_off_cuda_linear_silu_mul_is_linear_then_silu_mul():
    """CPU (dense, oneDNN-packed, int8 weights, with a bias): the torch composition, bit for bit."""
    from ops.quant.int_linear import quantize_int8

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=gen).bfloat16()
    dense = torch.randn(16, 32, generator=gen).bfloat16()
    bias = torch.randn(16, generator=gen).bfloat16()
    weights = [dense, quantize_int8(dense)]
    if ops.can_pack(torch.bfloat16):
        weights.append(ops.pack_weight(dense))
    for weight in weights:
        gate_up = ops.linear(x, weight, bias)
        want = F.silu(gate_up[:, :8]) * gate_up[:, 8:]
        assert torch.equal(ops.linear_silu_mul(x, weight, bias), want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kind", ["fp8", "int8", "bf16"])
@pytest.mark.parametrize("n,k", [(16384, 2048), (28672, 4096), (200, 304)])
@pytest.mark.parametrize("m", [1, 4, 9])
def test_cuda_gate_up_with_silu_in_the_epilogue_equals_the_gemv_then_silu_mul(
    kind, m, n, k, monkeypatch
):
    """ops.linear_silu_mul on an Fp8Weight / Int8Weight / bf16 weight at decode rows (the
    Llama-1B / 8B gate/up projections and a small one) equals ops.linear followed by the SiLU-mul
    kernel bit for bit, and torch's F.silu(gate) * up within bf16 rounding; where ops.linear ran
    the GEMV, the gated GEMV ran (counted)."""
    from ops.activation import silu_mul
    from ops.quant import fp8, gemv_triton, int_linear

    linear_module = importlib.import_module("ops.linear")
    monkeypatch.setattr(linear_module, "_SILU_MODE", ["on"])  # every shape, not only SILU_FASTER
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen).bfloat16().cuda()
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16().cuda()
    weight = {"fp8": fp8.quantize_fp8, "int8": int_linear.quantize_int8}.get(kind, lambda t: t)(w)
    calls = []
    real = gemv_triton.gemv
    monkeypatch.setattr(
        gemv_triton, "gemv", lambda *a, **kw: calls.append(kw.get("gated")) or real(*a, **kw)
    )
    gate_up = ops.linear(x, weight)
    unfused = len(calls)
    got = ops.linear_silu_mul(x, weight)
    assert (True in calls) == (unfused > 0), calls  # fused exactly where the GEMV ran
    assert torch.equal(got, silu_mul(gate_up))
    ref = F.silu(gate_up[:, : n // 2].float()) * gate_up[:, n // 2 :].float()
    torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=1e-5)
