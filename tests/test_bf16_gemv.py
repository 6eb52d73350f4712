"""The GEMV of ops/quant/gemv_triton.py on plain bf16 weights (no scale, optional bias) against
the fp32 matmul, and the one-row CUDA routing of ops.linear to it: on CPU through Triton's
interpreter (skipped where triton is not installed, as in CI), on CUDA for real (`pytest -m gpu`)
at the Llama-3.2-1B / 3.1-8B shapes, against F.linear, and under CUDA-graph capture.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import assert_interpreter_ok

import ops
from ops.quant import gemv_tiles

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

# (M, N, K, config, bias): ragged N and K (masked tails), slices wider than K, split-K 2-4 ways
# and a split that does not divide K (run unsplit), several rows, the rule's tile (None)
CASES = [(1, 40, 96, None, False), (1, 33, 1000, (16, 256, 4, 1), True),
         (1, 7, 300, (1, 256, 4, 1), True), (1, 64, 2048, (2, 1024, 4, 1), False),
         (1, 40, 1024, (8, 128, 4, 4), True), (1, 24, 300, (8, 128, 4, 2), False),
         (1, 130, 512, (4, 128, 4, 2), True), (3, 64, 512, (16, 128, 4, 1), True),
         (2, 24, 2048, None, False)]  # fmt: skip


def bf16_case(m, n, k, has_bias, dtype=torch.bfloat16, device="cpu", seed=0):
    """(x, weight, bias or None, fp32 oracle x @ w.T + b) with values exact in `dtype`."""
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) * 0.05).to(dtype)
    b = torch.randn(n, generator=gen, device=device).to(dtype) if has_bias else None
    want = x.float() @ w.float().T + (0 if b is None else b.float())
    return x, w, b, want


def rel_err(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


INTERPRETER_CHECK = """
import torch
from test_bf16_gemv import CASES, bf16_case, rel_err
from ops.quant.gemv_triton import _workspaces, gemv
for i, (m, n, k, cfg, has_bias) in enumerate(CASES):
    x, w, b, want = bf16_case(m, n, k, has_bias, seed=i)
    got = gemv(x, w, None, cfg, bias=b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n), (got.dtype, got.shape)
    # every element written (torch.empty garbage would not pass), within one bf16 step of the
    # fp32 oracle (the interpreter truncates fp32 -> bf16)
    assert torch.isfinite(got).all() and rel_err(got, want) < 1e-2, (m, n, k, cfg)
    close = (got.float() - want).abs() <= want.abs() * 2**-7 + 1e-3
    assert close.all(), (m, n, k, cfg, (got.float() - want).abs().max())
assert not _workspaces[torch.device("cpu")][1].any()  # split calls reset their counters
# fp32 weights and activations: the sums themselves, no output rounding
for i, (m, n, k, cfg, has_bias) in enumerate(CASES[:6]):
    x, w, b, want = bf16_case(m, n, k, has_bias, dtype=torch.float32, seed=i)
    torch.testing.assert_close(gemv(x, w, None, cfg, bias=b), want, rtol=1e-4, atol=1e-4)
print("ok")
"""


@pytest.mark.skipif(
    HAS_CUDA or not HAS_TRITON, reason="CPU interpreter check (with CUDA the kernel runs for real)"
)
def test_bf16_gemv_equals_the_fp32_matmul_in_the_interpreter():
    assert_interpreter_ok(INTERPRETER_CHECK)


@pytest.fixture
def bf16_table(monkeypatch):
    """A bf16 table measured for [1024, 2048] (GEMV faster) and [512, 2048] (cuBLAS faster)."""
    monkeypatch.setattr(gemv_tiles, "BF16_CONFIGS", {(1, 1024, 2048): (2, 1024, 4, 1),
                                                     (1, 512, 2048): (4, 512, 4, 1)})  # fmt: skip
    monkeypatch.setattr(gemv_tiles, "BF16_CUBLAS_FASTER", {(1, 512, 2048)})


def test_bf16_takes_the_gemv_where_the_mode_and_table_say(bf16_table):
    takes = gemv_tiles.bf16_takes_gemv
    # auto: the measured-faster shape only; on: every one-row shape; off and 2+ rows: never
    assert [takes(1, n, 2048, "auto") for n in (1024, 512, 4096)] == [True, False, False]
    assert [takes(1, n, 2048, "on") for n in (1024, 512, 4096)] == [True, True, True]
    assert not any(takes(m, 1024, 2048, mode) for m, mode in ((1, "off"), (2, "on"), (2, "auto")))
    assert gemv_tiles.pick_bf16_config(1, 1024, 2048) == (2, 1024, 4, 1)
    assert gemv_tiles.pick_bf16_config(1, 4096, 14336) == (4, 1024, 4, 1)  # the rule
    assert gemv_tiles.pick_bf16_config(1, 28672, 300) == (8, 512, 8, 1)


def test_bf16_gemv_switch_reads_the_mode_and_the_written_table(monkeypatch, tmp_path):
    monkeypatch.setattr(gemv_tiles, "BF16_CONFIGS", {})
    monkeypatch.setattr(gemv_tiles, "BF16_CUBLAS_FASTER", set())
    monkeypatch.setattr(gemv_tiles, "BF16_DOT", {})
    path = tmp_path / "bf16.json"  # the format tools/bench_gemv.py --write-configs writes
    path.write_text(json.dumps({"dtype": "bf16", "configs": [[[1, 3072, 2048], [4, 1024, 8, 1]],
                                                             [[1, 128256, 2048], [8, 256, 4, 1]]],
                                "cublas_faster": [[1, 128256, 2048]],
                                "dot": [[[1, 3072, 2048], 4]]}))  # fmt: skip
    monkeypatch.setenv(gemv_tiles.ENV_BF16_GEMV, " Auto")
    monkeypatch.setenv(gemv_tiles.ENV_BF16_GEMV_CONFIGS, str(path))
    assert gemv_tiles.bf16_gemv_mode() == "auto"
    assert gemv_tiles.BF16_CONFIGS == {(1, 3072, 2048): (4, 1024, 8, 1),
                                       (1, 128256, 2048): (8, 256, 4, 1)}  # fmt: skip
    assert gemv_tiles.bf16_takes_gemv(1, 3072, 2048, "auto")
    assert not gemv_tiles.bf16_takes_gemv(1, 128256, 2048, "auto")
    # tools/bench_gemv_dot.py's file also names the shapes that run the tensor-core loop
    assert gemv_tiles.bf16_takes_dot(1, 3072, 2048) and not gemv_tiles.bf16_takes_dot(2, 3072, 2048)
    assert gemv_tiles.dot_stages(1, 3072, 2048, plain=True) == 4
    monkeypatch.setenv(gemv_tiles.ENV_BF16_GEMV, "yes")
    with pytest.raises(ValueError, match="TORCH_RUNNER_BF16_GEMV='yes': allowed values are auto"):
        gemv_tiles.bf16_gemv_mode()


def test_one_row_route_takes_only_row_major_bf16_weights_the_mode_routes(monkeypatch, bf16_table):
    linear_mod = importlib.import_module("ops.linear")  # `ops.linear` is the function

    route = linear_mod._one_row_route
    x, w = torch.randn(1, 2048).bfloat16(), torch.randn(1024, 2048).bfloat16()
    monkeypatch.setattr(linear_mod, "_ONE_ROW_MODE", ["on"])
    assert route(x.float(), w.float(), None) is None  # fp32
    assert route(x, torch.randn(2048, 1024).bfloat16().t(), None) is None  # column-major
    assert route(x, w, torch.randn(1024)) is None  # an fp32 bias
    assert route(x, w, torch.randn(2048).bfloat16()[::2]) is None  # a strided bias
    monkeypatch.setattr(linear_mod, "_ONE_ROW_MODE", ["auto"])
    assert route(x, w[:512], None) is None  # measured, cuBLAS faster
    monkeypatch.setattr(linear_mod, "_ONE_ROW_MODE", ["off"])
    assert route(x, w, None) is None
    if HAS_TRITON:  # routed: the GEMV and the table's tile
        monkeypatch.setattr(linear_mod, "_ONE_ROW_MODE", ["auto"])
        gemv, config = route(x, w, torch.randn(1024).bfloat16())
        assert gemv.__name__ == "gemv" and config == (2, 1024, 4, 1)


LLAMA_SHAPES = [(3072, 2048), (2048, 2048), (512, 2048), (8192, 2048), (16384, 2048),
                (2048, 8192), (128256, 2048), (6144, 4096), (4096, 4096), (1024, 4096),
                (14336, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]  # fmt: skip
GPT_OSS_SHAPES = [(5120, 2880), (2880, 4096), (32, 2880), (201088, 2880)]  # K = 2880: masked
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("n,k", LLAMA_SHAPES + GPT_OSS_SHAPES)
def test_cuda_bf16_gemv_equals_f_linear_at_the_decode_shapes(n, k):
    """The table's tile (else the rule's) and a 4-way split at every 1B / 8B / gpt-oss-20b dense
    projection (a split that does not divide K runs unsplit): as close to
    the fp32 product as cuBLAS (one bf16 rounding each), with and without a bias."""
    from ops.quant.gemv_triton import gemv

    x, w, b, want = bf16_case(1, n, k, True, device="cuda", seed=n + k)
    ref, ref_nb = F.linear(x, w, b), F.linear(x, w)
    for cfg in (None, (4, 512, 4, 4)):
        for bias, base in ((b, ref), (None, ref_nb)):
            oracle = want - (0 if bias is not None else b.float())
            got = gemv(x, w, None, cfg, bias=bias)
            assert got.dtype == torch.bfloat16 and got.shape == (1, n)
            # one bf16 rounding step of the fp32 product (+ fp32 summation-order slack)
            slack = oracle.abs() * 2**-8 + 1e-3 * oracle.abs().max()
            assert ((got.float() - oracle).abs() <= slack).all(), (n, k, cfg)
            assert rel_err(got, base) < 4e-3, (n, k, cfg)
            assert torch.equal(gemv(x, w, None, cfg, bias=bias), got)  # repeatable (splits)


@pytest.fixture
def routes(monkeypatch):
    """ops.linear's one-row routes cleared (and cleared again after), the GEMV's calls counted."""
    linear_mod = importlib.import_module("ops.linear")  # `ops.linear` is the function
    from ops.quant import gemv_triton

    calls = []
    real = gemv_triton.gemv
    monkeypatch.setattr(
        gemv_triton, "gemv", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw)
    )
    linear_mod._ONE_ROW_ROUTES.clear()
    linear_mod._ONE_ROW_MODE.clear()
    yield calls
    linear_mod._ONE_ROW_ROUTES.clear()
    linear_mod._ONE_ROW_MODE.clear()


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("mode", ["on", "auto", "off"])
def test_cuda_one_row_bf16_linear_routes_by_the_switch(mode, monkeypatch, routes, bf16_table):
    monkeypatch.setenv(gemv_tiles.ENV_BF16_GEMV, mode)
    monkeypatch.delenv(gemv_tiles.ENV_BF16_GEMV_CONFIGS, raising=False)
    for n in (1024, 512):
        x, w, b, want = bf16_case(1, n, 2048, n == 512, device="cuda", seed=n)
        got = ops.linear(x.view(1, 1, -1), w, b)  # [B, N, K] as the models call it
        assert got.shape == (1, 1, n) and rel_err(got, want) < 4e-3
        two = ops.linear(torch.cat([x, x]), w, b)  # two rows: cuBLAS
        assert rel_err(two[1:], want) < 4e-3
    routed = {"on": [(1024, 2048), (512, 2048)], "auto": [(1024, 2048)], "off": []}[mode]
    assert [tuple(s) for s in routes] == routed
    routes.clear()
    x = torch.randn(1, 2048, device="cuda")  # fp32: never routed
    ops.linear(x, torch.randn(1024, 2048, device="cuda"))
    ops.linear(x.bfloat16(), torch.randn(2048, 1024, device="cuda").bfloat16().t())  # strided
    assert routes == []


@pytest.mark.gpu
@cuda_only
def test_cuda_one_row_bf16_linear_runs_the_gemv_inside_a_cuda_graph(monkeypatch, routes):
    """Captured with sync-debug on (no host sync), replayed on new inputs: equals F.linear."""
    monkeypatch.setenv(gemv_tiles.ENV_BF16_GEMV, "on")
    x, w, b, _ = bf16_case(1, 3072, 2048, True, device="cuda", seed=3)
    static_x = x.clone()
    ops.linear(static_x, w, b)  # compile and route outside the capture
    torch.cuda.synchronize()
    routes.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.linear(static_x, w, b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [tuple(s) for s in routes] == [(3072, 2048)]  # captured the GEMV, not cuBLAS
    x2 = torch.randn_like(x)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, F.linear(x2, w, b)) < 4e-3
