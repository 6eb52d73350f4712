"""The one-row / few-row GEMV for fp8 and int8 weights (ops/quant/gemv_triton.py) against the
dequantised-weights product in fp32: on CPU through Triton's interpreter (skipped where triton is
not installed, as in CI), on CUDA for real (`pytest -m gpu`), including the routing of
`Fp8Weight` / `Int8Weight` decode matmuls to it and a CUDA-graph replay.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from triton_interpreter import assert_interpreter_ok

import ops

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

# (M, N, K, config): ragged N and K, every BLOCK_M, tiles smaller than the shapes, split-K
# 2-8 ways (and one split that does not divide K: run unsplit)
CASES = [(1, 40, 96, None), (3, 64, 512, None), (8, 20, 300, (8, 128, 4, 1)),
         (1, 33, 1024, (16, 256, 4, 1)), (5, 16, 256, (4, 64, 4, 1)), (2, 24, 2048, None),
         (1, 40, 1024, (8, 128, 4, 4)), (3, 64, 512, (16, 128, 4, 2)),
         (8, 20, 2048, (8, 256, 4, 8)), (1, 24, 300, (8, 128, 4, 2))]  # fmt: skip


BLOCK_CASES = [(1, 200, 300, (128, 128), None), (3, 64, 512, (32, 64), (8, 512, 4, 1)),
               (1, 96, 1024, (32, 128), (4, 1024, 8, 2)), (8, 40, 256, (16, 128), (8, 256, 4, 1))]  # fmt: skip


def gemv_case(m, n, k, kind, dtype=torch.bfloat16, device="cpu", seed=0):
    """(x, packed weight, per-channel scale, fp32 oracle x @ dequantised(w).T)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 2).to(device=device, dtype=dtype)
    w = torch.randn(n, k, generator=gen)
    scale = torch.rand(n, generator=gen) + 0.5
    if kind == "fp8":
        packed = w.to(torch.float8_e4m3fn)
    else:  # int8 scales come in the activation dtype (ops/quant/int_linear.py)
        packed = (w * 40).round().clamp(-128, 127).to(torch.int8)
        scale = scale.to(dtype)
    packed, scale = packed.to(device), scale.to(device)
    want = x.float() @ (packed.float() * scale.float()[:, None]).T
    return x, packed, scale, want


def every_e4m3_code(n, k, device="cpu", seed=0):
    """An [n, k] e4m3 weight of random codes, each of the 254 non-NaN ones (subnormals, +-0,
    +-448) equally likely."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 254, (n, k), generator=gen)
    codes = codes + (codes >= 0x7F).long()  # skip 0x7F (NaN); 254 -> 255 never drawn, 0xFF NaN
    return codes.to(torch.uint8).view(torch.float8_e4m3fn).to(device)


def block_case(m, n, k, block, device="cpu", seed=0):
    """(x, e4m3 weight, block scales [ceil(n/bn), ceil(k/bk)], fp32 oracle), scales spread 16x."""
    from ops.quant.fp8 import dequantize

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).to(device)
    grid = (-(-n // block[0]), -(-k // block[1]))
    scale = (2 ** (torch.rand(grid, generator=gen) * 4 - 2)).to(device)
    return x, w, scale, x.float() @ dequantize(w, scale, block).T


def rel_err(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


INTERPRETER_CHECK = """
import torch
from test_ops_quant_gemv import BLOCK_CASES, CASES, block_case, every_e4m3_code, gemv_case, rel_err
from ops.quant.gemv_triton import _workspaces, gemv
for kind in ("fp8", "int8"):
    for i, (m, n, k, cfg) in enumerate(CASES):
        x, w, s, want = gemv_case(m, n, k, kind, seed=i)
        got = gemv(x, w, s, cfg)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n), (got.dtype, got.shape)
        # bf16 output rounding only; every element written (torch.empty garbage would not pass)
        assert torch.isfinite(got).all() and rel_err(got, want) < 1e-2, (kind, m, n, k)
        # within one bf16 step of the fp32 oracle (the interpreter truncates fp32 -> bf16)
        close = (got.float() - want).abs() <= want.abs() * 2**-7 + 1e-3
        assert close.all(), (kind, m, n, k)
    counts = _workspaces[torch.device("cpu")][1]
    assert not counts.any()  # every split call reset its counters for the next one
    for i, (m, n, k, cfg) in enumerate(CASES[:5]):  # slices widened to fp16 as loaded: exact
        x, w, s, want = gemv_case(m, n, k, kind, seed=i)
        assert torch.equal(gemv(x, w, s, cfg, widen=True), gemv(x, w, s, cfg, widen=False))
    x, w, s, want = gemv_case(3, 24, 200, kind, dtype=torch.float32, seed=9)
    # fp32: the sums themselves (2e-5 apart from the BLAS oracle: another summation order)
    torch.testing.assert_close(gemv(x, w, s), want, rtol=1e-4, atol=1e-4)
# one row, e4m3 read by bit placement: the conversion path's sums bit for bit (every code but NaN,
# subnormals and zeros included; x * 2^60 overflowing past 2^68 reruns the slices converted)
for i, (m, n, k, cfg) in enumerate(c for c in CASES if c[0] == 1):
    x, w, s, want = gemv_case(m, n, k, "fp8", seed=i)
    w = every_e4m3_code(n, k, seed=i)
    x[0, : k // 3] *= 2.0**70 if i == 1 else 1.0
    assert torch.equal(gemv(x, w, s, cfg, bits=True), gemv(x, w, s, cfg, bits=False, widen=True))
# block scales: ragged blocks at both edges, a tile wider than a block (sliced to it), split-K
for i, (m, n, k, block, cfg) in enumerate(BLOCK_CASES):
    x, w, s, want = block_case(m, n, k, block, seed=i)
    got = gemv(x, w, s, cfg, block=block)
    assert torch.isfinite(got).all() and rel_err(got, want) < 1e-2, (m, n, k, block)
# the tensor-core loop (dot=True): the FMA loop's result within fp32 summation order, split-K too;
# fp16 x past 65504 reruns the program's slices through the FMA loop: its bits
for i, (m, n, k, cfg) in enumerate([(1, 48, 256, (16, 64, 1, 1)), (3, 40, 512, (16, 128, 1, 2)),
                                    (8, 64, 128, (32, 64, 2, 1))]):
    x, w, s, want = gemv_case(m, n, k, "fp8", seed=i)
    got = gemv(x, w, s, cfg, dot=True)
    assert rel_err(got, gemv(x, w, s, cfg, dot=False)) < 1e-2 and rel_err(got, want) < 1e-2
    x[0, 3] = 1e6
    assert torch.equal(gemv(x, w, s, cfg, dot=True), gemv(x, w, s, cfg, dot=False, widen=True))
print("ok")
"""


@pytest.mark.skipif(
    HAS_CUDA or not HAS_TRITON, reason="CPU interpreter check (with CUDA the kernel runs for real)"
)
def test_gemv_equals_the_dequantised_matmul_in_the_interpreter():
    assert_interpreter_ok(INTERPRETER_CHECK)


def test_e4m3_bit_placement_is_each_code_times_2_pow_minus_120():
    """The one-row GEMV's conversion-free read of e4m3 (ops.quant.fp8.e4m3_bits_reference is its
    torch twin): exact for all 254 non-NaN codes, subnormals and -0 included; NaN reads as 480."""
    from ops.quant.fp8 import E4M3_F32_UNBIAS, e4m3_bits_reference

    codes = torch.arange(256).to(torch.uint8).view(torch.float8_e4m3fn)
    got = e4m3_bits_reference(codes).double() * 2.0**E4M3_F32_UNBIAS
    want = codes.double()
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite]) and int(finite.sum()) == 254
    assert torch.equal(got[finite].signbit(), want[finite].signbit())  # -0 stays -0
    assert got[~finite].tolist() == [480.0, -480.0]
    subnormal = e4m3_bits_reference(codes[1:8])
    assert (subnormal > 0).all() and (subnormal < torch.finfo(torch.float32).tiny).all()


def test_gemv_rejects_more_rows_than_it_holds():
    from ops.quant.gemv_tiles import MAX_ROWS, block_rows

    assert [block_rows(m) for m in (1, 2, 3, 5, MAX_ROWS)] == [1, 2, 4, 8, MAX_ROWS]
    with pytest.raises(ValueError, match=f"gemv takes 1..{MAX_ROWS} rows; got {MAX_ROWS + 1}"):
        block_rows(MAX_ROWS + 1)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (4100, 1000)])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_gemv_equals_the_dequantised_matmul(kind, m, n, k):
    from ops.quant.gemv_triton import gemv

    x, w, s, want = gemv_case(m, n, k, kind, device="cuda", seed=m * 7 + n)
    got = gemv(x, w, s)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got, want) < 5e-3
    # split-K partials are summed in split order and the counters reset: a repeat is identical
    assert torch.equal(gemv(x, w, s), got)
    # the weight slices widened to fp16 as loaded hold the same values: the same products
    assert torch.equal(gemv(x, w, s, widen=True), gemv(x, w, s, widen=False))


def exact_sum_case(n, k, dtype, device="cuda", seed=0):
    """x in {-2..2}, every e4m3 code of magnitude <= 2 (subnormals and +-0 included), power-of-
    two scales: every product and partial sum is a multiple of 2^-9 below 2^15, exact in fp32
    in any order, so any correct kernel gives the oracle's bits."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (1, k), generator=gen).to(dtype)
    codes = torch.randint(0, 0x41, (n, k), generator=gen) | (torch.randint(0, 2, (n, k)) << 7)
    w = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    s = 2.0 ** torch.randint(-3, 4, (n,), generator=gen).float()
    want = (x.double() @ (w.double() * s.double()[:, None]).T).to(dtype)
    return x.to(device), w.to(device), s.to(device), want.to(device)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "n,k,cfg",
    [
        (3072, 2048, None),
        (4100, 1000, None),
        (2048, 8192, (8, 512, 4, 4)),
        (40, 300, (8, 128, 4, 2)),
    ],
)
def test_cuda_e4m3_bits_gemv_is_exact_where_the_sums_are(dtype, n, k, cfg):
    """One row by bit placement (2^60 on x, 2^60 on the sum): on sums exact in fp32 it gives the
    oracle's bits, subnormal weights included, like the conversion path; on random data it
    stays within fp32 rounding of the conversion path (another summation order: its own layout)."""
    from ops.quant.gemv_triton import gemv

    x, w, s, want = exact_sum_case(n, k, dtype, seed=n + k)
    for bits in (True, False):
        assert torch.equal(gemv(x, w, s, cfg, bits=bits), want), bits
    x, _, s, _ = gemv_case(1, n, k, "fp8", dtype=dtype, device="cuda", seed=n + k)
    w = every_e4m3_code(n, k, device="cuda", seed=k)
    s = s * 2.0**-8  # fp16 outputs stay finite (|w| up to 448)
    got = gemv(x, w, s, cfg, bits=True)
    conv = gemv(x, w, s, cfg, bits=False, widen=True)
    want = x.float() @ (w.float() * s[:, None]).T
    assert rel_err(got, want) < (5e-3 if dtype != torch.float32 else 1e-5)
    assert rel_err(got, conv) < (5e-3 if dtype != torch.float32 else 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_e4m3_bits_gemv_with_huge_or_nonfinite_x_gives_what_the_conversion_path_gives(dtype):
    """|x| past 2^68 overflows x * 2^60: those programs rerun their slices converted, so huge,
    infinite and NaN activations come out as the conversion path's (inf where its fp32 sum
    overflows before the scale, finite where it does not)."""
    from ops.quant.gemv_triton import gemv

    n, k = 4096, 4096
    w = every_e4m3_code(n, k, device="cuda", seed=3)
    s = torch.rand(n, device="cuda") * 1e-20 + 1e-21  # huge x times tiny scales: finite outputs
    for value in (2.0**70, 2.0**100, 3.0e38, float("inf"), float("nan")):
        x = torch.randn(1, k, device="cuda").to(dtype)
        x[0, 7] = value
        got = gemv(x, w, s, bits=True)
        conv = gemv(x, w, s, bits=False, widen=True)
        assert torch.equal(got.isnan(), conv.isnan()) and torch.equal(got.isinf(), conv.isinf())
        assert torch.equal(got[got.isinf()], conv[conv.isinf()])
        finite = torch.isfinite(conv)
        if value < 2.0**110:  # 448 * |x| fits fp32: finite, as the conversion path
            assert finite.all()
        if finite.any():
            assert rel_err(got[finite], conv[finite]) < 1e-2
    x = torch.randn(1, k, device="cuda").to(dtype) * 2.0**-40  # tiny x: 2^60 keeps it normal
    s = torch.rand(n, device="cuda") + 0.5  # (outputs near 1e-10: rel_err's fp32 norm holds)
    want = x.double() @ (w.double() * s.double()[:, None]).T
    assert rel_err(gemv(x, w, s, bits=True).double(), want) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_fp8_weight_with_a_nan_byte_keeps_the_nan_through_the_conversion_path():
    """The bit placement would read an e4m3 NaN as 480: Fp8Weight sees the NaN at load and its
    one-row matmuls convert instead, so the NaN reaches the output as in the reference."""
    from ops.quant.fp8 import Fp8Weight

    w = every_e4m3_code(1024, 2048, device="cuda", seed=1)
    clean = Fp8Weight(w, torch.ones(1024), torch.bfloat16)
    w_nan = w.clone()
    w_nan.view(torch.uint8)[5, 9] = 0x7F
    packed = Fp8Weight(w_nan, torch.ones(1024), torch.bfloat16)
    assert clean.gemv_bits and not packed.gemv_bits
    got = ops.linear(torch.randn(1, 2048, device="cuda").bfloat16(), packed)
    assert got[0, 5].isnan() and torch.isfinite(got[0, torch.arange(1024) != 5]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "cfg", [(16, 128, 1, 1), (64, 128, 4, 1), (32, 256, 2, 4), (128, 64, 4, 2)]
)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_cuda_tensor_core_gemv_equals_the_oracle(cfg, m):
    """The tensor-core loop (x as 16 columns, one per row): exact where the sums are (fp8 and
    bf16 weights: every product and partial sum exact in fp32, so the oracle's bits), within bf16
    rounding of the fp32 oracle on random data, unwritten rows impossible (NaN-poisoned output
    buffers never leak: a second call equals the first), split-K counters reset."""
    from ops.quant.gemv_triton import _workspaces, gemv

    n, k = 4100, 2048
    x, w, s, want = exact_sum_case(n, k, torch.bfloat16, seed=m)
    x = x.expand(m, k).contiguous() if m > 1 else x
    want = want.expand(m, n) if m > 1 else want
    assert torch.equal(gemv(x, w, s, cfg, dot=True), want)
    wb = (w.float() * s[:, None]).bfloat16()  # small dyadic values: exact in bf16
    assert torch.equal(gemv(x, wb, None, cfg, dot=True), want)
    for kind in ("fp8", "int8"):
        x, w, s, want = gemv_case(m, n, k, kind, device="cuda", seed=m + len(kind))
        got = gemv(x, w, s, cfg, dot=True)
        assert torch.isfinite(got).all() and rel_err(got, want) < 5e-3, kind
        assert torch.equal(gemv(x, w, s, cfg, dot=True), got)
    wb = torch.randn(n, k, device="cuda").bfloat16()
    got = gemv(x, wb, None, cfg, dot=True)
    assert rel_err(got, x.float() @ wb.float().T) < 5e-3
    assert not _workspaces[x.device][1].any()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_tensor_core_gemv_with_x_past_fp16_gives_the_fma_loop_result():
    """x converts to fp16 for the tensor cores: past 65504 it is inf there, and the programs
    that see a non-finite sum rerun their slices through the FMA loop, so huge, infinite and
    NaN activations give the FMA loop's outputs bit for bit."""
    from ops.quant.gemv_triton import gemv

    n, k, cfg = 4096, 4096, (64, 128, 4, 1)
    w = every_e4m3_code(n, k, device="cuda", seed=5)
    s = torch.rand(n, device="cuda") * 1e-6 + 1e-7
    for value in (7.0e4, 1.0e30, float("inf"), float("nan")):
        x = torch.randn(1, k, device="cuda").bfloat16()
        x[0, 11] = value
        got = gemv(x, w, s, cfg, dot=True)
        fma = gemv(x, w, s, cfg, dot=False, widen=True)
        assert torch.equal(got.isnan(), fma.isnan())
        assert torch.equal(got[~got.isnan()], fma[~fma.isnan()]), value


TILE = (8, 256, 4, 1)


def measured_tables(monkeypatch):
    """A tile table measured for 2 and 4 rows of a [1024, 2048] weight, `_scaled_mm` faster at 4."""
    from ops.quant import gemv_tiles

    monkeypatch.setattr(gemv_tiles, "CONFIGS", {(2, 1024, 2048): TILE, (4, 1024, 2048): TILE})
    monkeypatch.setattr(gemv_tiles, "SCALED_MM_FASTER", {(4, 1024, 2048)})


def test_fp8_takes_the_gemv_where_the_table_measured_it_faster(monkeypatch):
    from ops.quant.gemv_tiles import fp8_takes_gemv, pick_config

    measured_tables(monkeypatch)
    # rows: 1 unmeasured (one row: GEMV), 2 measured faster, 3 -> bucket 4 where _scaled_mm won,
    # 5 -> bucket 8 unmeasured (past one row: _scaled_mm), 9 past the kernel
    assert [fp8_takes_gemv(m, 1024, 2048, 8) for m in (1, 2, 3, 5, 9)] == [
        True, True, False, False, False]  # fmt: skip
    assert not fp8_takes_gemv(1, 1024, 2048, 0) and not fp8_takes_gemv(2, 1024, 2048, 1)
    assert pick_config(2, 1024, 2048) == TILE
    assert pick_config(1, 1024, 2048) == (8, 512, 4, 1)  # the rule, for a shape not measured


def test_a_chain_table_marks_how_one_row_reads_e4m3_per_shape(monkeypatch):
    """bench_fp8_linear.py --chain writes 5-value tiles: the 5th says how one row read e4m3
    fastest (0 converted as loaded, 1 bit placement, 2 raw bytes); TORCH_RUNNER_GEMV_FP8_BITS
    auto follows it for bit placement, on / off override it."""
    from ops.quant import gemv_tiles

    monkeypatch.setattr(gemv_tiles, "CONFIGS", dict(gemv_tiles.CONFIGS))
    monkeypatch.setattr(gemv_tiles, "FP8_READS", dict(gemv_tiles.FP8_READS))
    gemv_tiles.set_configs({(1, 1024, 2048): (8, 256, 4, 1, 1), (1, 2048, 2048): (4, 512, 4, 1, 0),
                            (1, 4096, 2048): (4, 512, 4, 1, 2), (2, 1024, 2048): TILE})  # fmt: skip
    assert gemv_tiles.pick_config(1, 1024, 2048) == (8, 256, 4, 1)
    assert gemv_tiles.FP8_READS == {(1, 1024, 2048): 1, (1, 4096, 2048): 2}
    assert gemv_tiles.fp8_reads_raw(1, 4096, 2048) and not gemv_tiles.fp8_reads_raw(1, 1024, 2048)
    takes = gemv_tiles.fp8_takes_bits
    assert takes(1, 1024, 2048, "auto") and not takes(1, 2048, 2048, "auto")
    assert not takes(2, 1024, 2048, "auto") and not takes(2, 1024, 2048, "on")
    assert takes(1, 2048, 2048, "on") and not takes(1, 1024, 2048, "off")
    gemv_tiles.set_configs({(1, 1024, 2048): (32, 128, 2, 1, 3, 4), (1, 2048, 2048): TILE})
    assert gemv_tiles.fp8_takes_dot(1, 1024, 2048) and not gemv_tiles.fp8_takes_dot(1, 2048, 2048)
    assert gemv_tiles.dot_stages(1, 1024, 2048, plain=False) == 4
    assert gemv_tiles.pick_config(1, 1024, 2048) == (32, 128, 2, 1)
    # a product that cannot run the dot (block scales, fp32 x) takes the rule's FMA tile there
    assert gemv_tiles.pick_config(1, 1024, 2048, dot=False) == (8, 512, 4, 1)
    assert gemv_tiles.pick_config(1, 2048, 2048, dot=False) == TILE  # not a dot tile: kept
    monkeypatch.setenv(gemv_tiles.ENV_PREFETCH, " 16")
    assert gemv_tiles.prefetch_lines() == 16
    monkeypatch.setenv(gemv_tiles.ENV_PREFETCH, "12")  # tl.arange needs a power of two
    with pytest.raises(
        ValueError, match="TORCH_RUNNER_GEMV_PREFETCH_LINES='12': allowed values are 0, 1, 2"
    ):
        gemv_tiles.prefetch_lines()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_decode_matmuls_of_fp8_and_int8_weights_route_to_the_gemv(monkeypatch):
    """Fp8Weight takes the GEMV where the table says so (and equals the oracle), `_scaled_mm`
    elsewhere; Int8Weight takes it up to INT8_GEMV_MAX_ROWS rows, torch's kernel past them."""
    from ops.quant import fp8, gemv_triton, int_linear

    measured_tables(monkeypatch)
    calls = []
    real = gemv_triton.gemv
    monkeypatch.setattr(gemv_triton, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w = torch.randn(1024, 2048, device="cuda").bfloat16() * 0.02
    f8, i8 = fp8.quantize_fp8(w), int_linear.quantize_int8(w)
    limit = int_linear.INT8_GEMV_MAX_ROWS
    for packed, dense, routes in (
        (f8, f8.weight.float() * f8.scale[:, None], ((1, True), (2, True), (3, False), (5, False))),
        (i8, i8.qweight.float() * i8.scales.float()[:, None], ((1, True), (limit, True),
                                                               (limit + 1, False))),
    ):  # fmt: skip
        for m, routed in routes:
            calls.clear()
            x = torch.randn(m, 2048, device="cuda").bfloat16()
            got = ops.linear(x, packed)
            assert bool(calls) == routed, (type(packed).__name__, m)
            assert rel_err(got, x.float() @ dense.T) < (6e-2 if not routed else 5e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4])
def test_cuda_block_scaled_fp8_decode_runs_the_gemv_and_equals_the_dequantised_matmul(m):
    """A 128x128-block fp8 weight on CUDA: decode rows through the GEMV (not the per-matmul
    dequantisation), equal to the fp32 product of the dequantised weight."""
    from ops.quant.fp8 import Fp8Weight

    x, w, s, want = block_case(m, 3072, 2048 + 64, (128, 128), device="cuda", seed=m)
    packed = Fp8Weight(w, s, torch.bfloat16, (128, 128))
    assert packed.uses_block_gemv and not packed.uses_scaled_mm
    got = ops.linear(x, packed)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_gemv_replays_in_a_cuda_graph_without_host_sync():
    from ops.quant.gemv_triton import gemv

    x, w, s, want = gemv_case(2, 4096, 4096, "fp8", device="cuda")
    static_x = x.clone()
    gemv(static_x, w, s)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemv(static_x, w, s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x2, _, _, _ = gemv_case(2, 4096, 4096, "fp8", device="cuda", seed=5)
    static_x.copy_(x2)
    graph.replay()
    want2 = x2.float() @ (w.float() * s[:, None]).T
    assert rel_err(out, want2) < 5e-3


def test_one_row_of_int8_keeps_its_own_tiles():
    """int8 one-row tiles stay apart from the fp8 chain-tuned ones (which made int8 slower)."""
    from ops.quant.gemv_tiles import CONFIGS, INT8_ROW_CONFIGS, pick_config

    for key, tile in INT8_ROW_CONFIGS.items():
        assert pick_config(*key, int8=True) == tile
        assert pick_config(*key) == CONFIGS[key]
    assert pick_config(2, 2048, 2048, int8=True) == CONFIGS[(2, 2048, 2048)]  # 2+ rows: shared
