"""The GEMV's first weight slice loaded before the PDL wait (`TORCH_RUNNER_GEMV_PRELOAD`,
ops/quant/gemv_triton._first_slice, and the tensor-core loop's first slice taken out of its
loop): the same values as the plain loops, bit for bit, for fp8 / int8 / bf16 weights, e4m3 bit
placement, uneven K, split-K, several rows and both epilogues; on
CPU through Triton's interpreter (skipped where triton is not installed, as in CI), on CUDA for
real (`pytest -m gpu`), where a CUDA graph of PDL launches checks that x is read after the wait.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gemv_weights import random_weight
from triton_interpreter import assert_interpreter_ok

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

# (M, N, K, tile, kind, E4M3 bits): one row, several rows, uneven K, split-K, bits, int8, bf16
PRELOAD_CASES = [(1, 48, 256, (8, 64, 1, 1), "fp8", False), (3, 40, 200, (8, 64, 2, 1), "fp8", False),
                 (1, 64, 256, (16, 32, 1, 4), "fp8", False), (1, 32, 192, (4, 64, 1, 1), "fp8", True),
                 (2, 24, 160, (8, 32, 1, 1), "int8", False), (1, 40, 300, (4, 128, 1, 1), "bf16", False),
                 (2, 32, 256, (8, 64, 1, 2), "bf16", False)]  # fmt: skip


# (M, N, K, tile, kind) for the tensor-core loop: one slice, several, split-K, rows, int8 (not
# bf16 weights: Triton 3.6's interpreter returns no product for a bf16 tl.dot, ~1e11 off; the
# GPU test below and test_ops_quant_gemv's check them)
DOT_CASES = [(1, 32, 64, (16, 64, 1, 1), "fp8"), (1, 48, 256, (16, 64, 1, 1), "fp8"),
             (1, 64, 256, (32, 32, 2, 2), "fp8"), (3, 32, 128, (16, 32, 1, 1), "int8"),
             (2, 32, 192, (16, 64, 1, 1), "fp8")]  # fmt: skip


def preload_case(m, n, k, kind, seed, device="cpu"):
    """x [m, k] bf16 and a weight of `kind` with its per-channel scale (None for bf16)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w, s = random_weight(n, k, kind, gen)
    return x.to(device), w.to(device), None if s is None else s.to(device)


INTERPRETER_CHECK = """
import torch
from test_gemv_preload import DOT_CASES, PRELOAD_CASES, preload_case
from ops.quant.gemv_triton import gemv
for i, (m, n, k, cfg, kind, bits) in enumerate(PRELOAD_CASES):
    x, w, s = preload_case(m, n, k, kind, seed=i)
    want = gemv(x, w, s, cfg, bits=bits, dot=False, preload=False)
    got = gemv(x, w, s, cfg, bits=bits, dot=False, preload=True)
    assert torch.equal(got, want), (i, (got - want).abs().max())
    ref = (x.float() @ w.float().T) * (1 if s is None else s.float())
    assert torch.allclose(got.float(), ref, rtol=2e-2, atol=2e-2), i  # and it is the product
    if kind != "int8" and n % 2 == 0:  # the gated epilogue reads the same slices
        want = gemv(x, w, s, cfg, dot=False, gated=True, preload=False)
        assert torch.equal(gemv(x, w, s, cfg, dot=False, gated=True, preload=True), want), i
for i, (m, n, k, cfg, kind) in enumerate(DOT_CASES):  # the tensor-core loop, its first slice peeled
    x, w, s = preload_case(m, n, k, kind, seed=40 + i)
    want = gemv(x, w, s, cfg, dot=True, preload=False)
    got = gemv(x, w, s, cfg, dot=True, preload=True)
    assert torch.equal(got, want), ("dot", i, (got - want).abs().max())
    ref = (x.float() @ w.float().T) * (1 if s is None else s.float())
    assert torch.allclose(got.float(), ref, rtol=2e-2, atol=2e-2), ("dot", i)
print("ok")
"""


@pytest.mark.skipif(
    HAS_CUDA or not HAS_TRITON, reason="CPU interpreter check (with CUDA the kernel runs for real)"
)
def test_preloaded_gemv_equals_the_plain_loop_in_the_interpreter():
    assert_interpreter_ok(INTERPRETER_CHECK)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kind", ["fp8", "int8", "bf16"])
# the last two: the tensor-core loop's fp8 shapes (Llama-1B gate/up, Llama-8B down)
@pytest.mark.parametrize(
    "n,k", [(2048, 2048), (3072, 2048), (2048, 8192), (6144, 4096), (40, 300), (16384, 2048),
            (4096, 14336)]
)  # fmt: skip
def test_cuda_preload_in_a_pdl_graph_chain_equals_the_plain_loop(kind, n, k):
    """A CUDA graph of two GEMVs, the second reading the first's output (PDL launches where the
    GPU has them): with the second preloading, every replay with a new input equals the plain
    chain run eagerly, bit for bit, at the table's tile (a stale x would differ)."""
    from ops.quant.gemv_triton import gemv

    x, w1, s1 = preload_case(1, k, k, "bf16", seed=n, device="cuda")
    _, w2, s2 = preload_case(1, n, k, kind, seed=k, device="cuda")
    w1 = w1 / k**0.5
    static_x = x.clone()
    gemv(static_x, w2, s2, preload=True)  # compiled outside the capture
    gemv(gemv(static_x, w1, None), w2, s2, preload=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(gemv(static_x, w1, None), w2, s2, preload=True)
    for step in range(3):
        static_x.copy_(torch.randn(x.shape, device="cuda", generator=None).bfloat16())
        graph.replay()
        want = gemv(gemv(static_x, w1, None, preload=False), w2, s2, preload=False)
        torch.cuda.synchronize()
        assert torch.equal(out, want), (step, (out.float() - want.float()).abs().max())
