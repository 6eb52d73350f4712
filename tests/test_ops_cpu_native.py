"""The native CPU kernels (ops/cpu_native; AVX-512 where the CPU has it, else AVX2).

Oracles: the pure-torch reference of the same math (ops/cpu_native/reference.py: only the fp32
summation order differs, so a tight tolerance) and an fp64 brute-force dot product built from
the raw format fields (nibbles unpacked with integer ops, q8 codes times their scales), at the
SmolLM2 shapes and at odd ones (K not a multiple of 32, N not a multiple of the 4-row block).
"""

import threading

import pytest
import torch

from ops.cpu_native import build, reference
from ops.cpu_native import weights as weights_module
from ops.cpu_native.weights import (
    DENSE_MAX_ROWS,
    TILED_FP32_MAX_ROWS,
    NativeDenseWeight,
    NativeInt4Weight,
    NativeInt8Weight,
    NativePackedDenseWeight,
)
from ops.quant.int_linear import dequantize_int4, int4_codes, pack_int4

pytestmark = pytest.mark.skipif(not build.has_avx2(), reason="needs an x86-64 CPU with AVX2")
SHAPES = [(1, 960, 576), (1, 576, 1536), (1, 49152, 576), (3, 13, 64), (2, 3072, 576)]
ODD_K = [(1, 13, 70), (2, 7, 5)]  # int8 / dense: a tail block of K % 32 columns


@pytest.fixture(scope="module")
def lib():
    ops = build.native_ops()
    assert ops is not None, "the native library did not build"
    return ops


def brute_force(x_deq: torch.Tensor, w: torch.Tensor):
    """(fp64 x_deq @ w.T, the fp32 error bound's scale |x| @ |w|.T)."""
    x64, w64 = x_deq.double(), w.double()
    return x64 @ w64.T, x64.abs() @ w64.abs().T


def q8_dequantized(lib, x: torch.Tensor) -> torch.Tensor:
    """The kernel's own q8 codes times their scales, [M, K] (fp64 math, no reference code)."""
    codes, d, _ = lib.quantize_q8(x)
    m, k = x.shape
    return (codes.double().view(m, -1, 32) * d.double()[..., None]).view(m, -1)[:, :k]


def check(got, want_ref, want64, scale, out_dtype):
    """Tight vs the reference, and within fp32 summation error (+ one output rounding) of fp64."""
    ulp = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-23
    torch.testing.assert_close(
        got.double(), want_ref.double(), rtol=2 * ulp, atol=1e-5 * scale.max().item()
    )
    err = (got.double() - want64).abs()
    assert (err <= 1e-5 * scale + ulp * want64.abs() + 1e-30).all(), err.max()


def test_q8_codes_match_the_reference_exactly(lib):
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 1536).to(dtype)
        x[0, :32] = 0  # an all-zero block: d = 0, codes 0
        x[1, 40] = 1e4  # one large value in a block
        for k in (1536, 70):
            got, want = lib.quantize_q8(x[:, :k].contiguous()), reference.quantize_q8(x[:, :k])
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=0)
            assert got[0].abs().max() <= 127


@pytest.mark.parametrize("m,n,k", SHAPES + ODD_K)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_gemv_vs_reference_and_fp64(lib, m, n, k, dtype):
    torch.manual_seed(n + k)
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    bias, res = torch.randn(n).to(dtype), torch.randn(m, n).to(dtype)
    got = NativeDenseWeight(w).linear_add(x, bias, res)
    want64, scale = brute_force(x, w)
    want64 = want64 + bias.double() + res.double()
    check(got, reference.dense_linear(x, w, bias, res), want64, scale, dtype)


def test_packed_tiles_hold_each_value_where_the_layout_says():
    """tiles[b, c, r, l] is w[4 b + r, 16 c + l] (the index formula, value by value)."""
    w = torch.arange(8 * 48, dtype=torch.float32).view(8, 48)
    tiles = reference.tile_rows(w)
    assert tiles.shape == (2, 3, 4, 16) and tiles.is_contiguous()
    for b, c, r, j in [(0, 0, 0, 0), (1, 2, 3, 15), (0, 1, 2, 5), (1, 0, 1, 9)]:
        assert tiles[b, c, r, j] == w[4 * b + r, 16 * c + j]
    flat = tiles.flatten()  # row 5's values 16..31 follow rows 4's 16..31 in memory
    assert torch.equal(flat[(1 * 3 + 1) * 64 + 16 : (1 * 3 + 1) * 64 + 32], w[5, 16:32])
    assert torch.equal(reference.untile_rows(tiles), w)
    out = torch.full_like(w, float("nan"))  # into a given [N, K] (the MKL path's scratch)
    assert reference.untile_rows(tiles, out=out) is out and torch.equal(out, w)


PACKED_SHAPES = [(1, 960, 576), (1, 576, 1536), (2, 3072, 576), (3, 12, 64), (8, 4, 16)]


@pytest.mark.parametrize("m,n,k", PACKED_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_dense_gemv_is_the_rows_gemv_bit_for_bit(lib, m, n, k, dtype):
    """Same sums in the same order as the row-major GEMV, and within fp32 error of fp64."""
    torch.manual_seed(n + k)
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    bias, res = torch.randn(n).to(dtype), torch.randn(m, n).to(dtype)
    packed = NativePackedDenseWeight(w)
    got = packed.linear_add(x, bias, res)
    assert torch.equal(got, NativeDenseWeight(w).linear_add(x, bias, res))
    want64, scale = brute_force(x, w)
    check(got, reference.dense_linear(x, w, bias, res), want64 + bias.double() + res.double(),
          scale, dtype)  # fmt: skip
    assert torch.equal(packed.dequantize(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [DENSE_MAX_ROWS + 5, TILED_FP32_MAX_ROWS + 3])
def test_packed_dense_prefill_and_the_reference_fallback(lib, monkeypatch, dtype, m):
    """Many rows (the kernel, or MKL on an untiled copy for fp32 past TILED_FP32_MAX_ROWS);
    without the library the reference runs: each the fp64 product within fp32 error."""
    torch.manual_seed(1)
    w, x = torch.randn(64, 96).to(dtype), torch.randn(m, 96).to(dtype)
    packed = NativePackedDenseWeight(w)
    want64, scale = brute_force(x, w)
    check(packed.linear(x, None), reference.dense_linear(x, w), want64, scale, dtype)
    if m > TILED_FP32_MAX_ROWS and dtype == torch.float32:  # MKL on the shared scratch rows
        monkeypatch.setattr(weights_module, "_UNTILED", threading.local())
        with torch.inference_mode():  # the engine's mode: the scratch must outlive it, writable
            big = NativePackedDenseWeight(torch.randn(128, 96).to(dtype))
            check(big.linear(x, None), reference.dense_linear(x, big.dequantize()),
                  *brute_force(x, big.dequantize()), dtype)  # fmt: skip
        other = NativePackedDenseWeight(torch.randn(32, 96).to(dtype))
        outs = {}  # another thread's products use its own scratch, never this one's

        def in_thread():
            outs["y"] = other.linear(x, None)
            outs["ptr"] = weights_module._UNTILED.by_dtype[dtype].data_ptr()

        worker = threading.Thread(target=in_thread)
        worker.start()
        worker.join()
        check(outs["y"], reference.dense_linear(x, other.dequantize()),
              *brute_force(x, other.dequantize()), dtype)  # fmt: skip
        assert outs["ptr"] != weights_module._UNTILED.by_dtype[dtype].data_ptr()
        check(other.linear(x, None), reference.dense_linear(x, other.dequantize()),
              *brute_force(x, other.dequantize()), dtype)  # fmt: skip
        check(packed.linear(x, None), reference.dense_linear(x, w), want64, scale, dtype)
        monkeypatch.setattr(weights_module, "UNTILED_MAX_BYTES", 0)  # a temporary instead
        check(packed.linear(x, None), reference.dense_linear(x, w), want64, scale, dtype)
    monkeypatch.setattr(packed, "lib", None)
    few = x[:3].contiguous()
    assert torch.equal(packed.linear(few, None), reference.dense_linear(few, w))


def test_packed_dense_bad_shapes_are_clear_errors(lib):
    with pytest.raises(ValueError, match="N=6 must be a multiple of 4"):
        NativePackedDenseWeight(torch.ones(6, 32))
    with pytest.raises(ValueError, match="K=40 of 16"):
        NativePackedDenseWeight(torch.ones(8, 40))
    with pytest.raises(RuntimeError, match=r"\[N / 4, K / 16, 4, 16\]"):
        lib.dense_packed_linear(torch.ones(1, 32), torch.ones(8, 32), None, None)
    with pytest.raises(RuntimeError, match="takes K=32"):
        lib.dense_packed_linear(torch.ones(1, 16), torch.ones(2, 2, 4, 16), None, None)
    codes, scales = torch.ones(2, 3, 4, 32, dtype=torch.int8), torch.ones(8)  # N=8, K=96 tiled
    with pytest.raises(
        RuntimeError, match=r"\[N / 4, ceil\(K / 32\), 4, 32\]; got \[2, 3, 4, 32\] for K=64"
    ):
        lib.int8_linear(torch.ones(1, 64), codes, scales, 64, None, None, False)
    with pytest.raises(RuntimeError, match=r"scales must be float32 \[N\]"):
        lib.int8_linear(torch.ones(1, 96), codes, torch.ones(6), 96, None, None, False)
    out = lib.int8_linear(torch.ones(1, 96), codes, scales, 96, None, None, False)
    torch.testing.assert_close(out, torch.full((1, 8), 96.0))  # 96 ones times codes of 1


@pytest.mark.parametrize("m,n,k", SHAPES + ODD_K)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lowest", [-127, -128])  # -128 codes: the kernel's full-range variant
def test_int8_q8_kernel_vs_reference_and_fp64(lib, m, n, k, dtype, lowest):
    torch.manual_seed(n + k)
    x = torch.randn(m, k).to(dtype)
    qweight = torch.randint(lowest, 128, (n, k), dtype=torch.int8)
    qweight[0, 0] = lowest
    if lowest == -128:
        qweight[-1, -4:] = -128  # in the last (possibly single-row) block and the tail columns
    scales = torch.rand(n) / 100
    weight = NativeInt8Weight(qweight, scales, dtype)
    assert weight.is_full_range == (lowest == -128)
    got = weight.linear(x, None)
    want64, scale = brute_force(q8_dequantized(lib, x), qweight.double() * scales.double()[:, None])
    want_ref = reference.int8_linear(x, weight.qweight, weight.scales, k)
    check(got, want_ref, want64, scale, dtype)
    tiled = NativeInt8Weight(qweight, scales, dtype, tiled=True)  # [N / 4, Kp / 32, 4, 32]
    assert tiled.is_tiled == (n % 4 == 0)
    assert torch.equal(tiled.rows(), weight.qweight)
    assert torch.equal(tiled.linear(x, None), got)  # the same sums in the same order


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_q8_kernel_vs_reference_and_fp64(lib, m, n, k, dtype, group):
    torch.manual_seed(n + k + group)
    x = torch.randn(m, k).to(dtype)
    codes, scales, zeros = int4_codes(torch.randn(n, k), group)
    weight = NativeInt4Weight.from_codes(codes, scales, zeros, group, dtype)
    got = weight.linear_add(x, None, torch.ones(m, n).to(dtype))
    dm = weight.dm.double()  # the stored fp16 scales [N, 0, K/32] and mins [N, 1, K/32]
    w64 = codes.double().view(n, k // 32, 32) * dm[:, 0, :, None] + dm[:, 1, :, None]
    w64 = w64.view(n, k)
    want64, scale = brute_force(q8_dequantized(lib, x), w64)
    want_ref = reference.int4_linear(x, weight.qs, weight.dm, None, torch.ones(m, n).to(dtype))
    check(got, want_ref, want64 + 1, scale, dtype)


def test_int4_layout_dequantizes_to_torchs_int4_weight():
    """The re-packed format holds the same weight as ops/quant's torch-layout Int4Weight."""
    codes, scales, zeros = int4_codes(torch.randn(64, 128), 32)
    torch_layout = pack_int4(codes, scales, zeros, 32, torch.float32, keep_codes=True)
    want = dequantize_int4(torch_layout.codes, torch_layout.scales_and_zeros, 32)
    got = NativeInt4Weight.from_codes(codes, scales, zeros, 32, torch.float32).dequantize()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)  # scale and min in fp16


def test_bad_inputs_are_clear_errors(lib):
    with pytest.raises(ValueError, match="multiples of 32"):
        NativeInt4Weight.from_codes(torch.zeros(8, 48, dtype=torch.int32), torch.ones(8, 1),
                                    torch.zeros(8, 1), 48, torch.float32)  # fmt: skip
    weight = NativeInt8Weight(torch.ones(4, 32, dtype=torch.int8), torch.ones(4), torch.float32)
    with pytest.raises(RuntimeError, match="takes K=31"):
        lib.int8_linear(torch.ones(1, 30), weight.qweight, weight.scales, 31, None, None, False)
    with pytest.raises(RuntimeError, match="dtype"):
        lib.dense_linear(torch.ones(1, 8, dtype=torch.float16), torch.ones(4, 8), None, None)


def test_kernel_mode_env_is_validated(monkeypatch):
    monkeypatch.setenv(build.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="allowed values: native, torch"):
        build.kernel_mode()
    monkeypatch.setenv(build.KERNELS_ENV, "torch")
    assert not build.wants_native("cpu")
    monkeypatch.setenv(build.KERNELS_ENV, "native")
    assert build.wants_native("cpu") and not build.wants_native("meta")


@pytest.mark.parametrize("dtype,quantization", [("float32", "int4"), ("bfloat16", "int8"),
                                                ("float32", "none")])  # fmt: skip
def test_engine_greedy_tokens_native_equal_the_reference_math(llama, monkeypatch, dtype,
                                                              quantization):  # fmt: skip
    """The engine on native kernels gives the greedy tokens of the pure-torch reference path."""
    from ops.cpu_native import weights as native_weights
    from torch_runner import Engine, SamplingParams

    def run():
        engine = Engine(llama[0], device="cpu", dtype=dtype, quantization=quantization,
                        max_total_tokens=256, block_size=4, max_num_seqs=4)  # fmt: skip
        kinds = {type(engine.runner.model.lm_head.weight).__name__}
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
        outs = engine.generate([[5, 6, 7], [100] * 11], params)
        return [o.token_ids for o in outs], kinds

    native, kinds = run()
    allowed = {"NativeDenseWeight", "NativePackedDenseWeight", "NativeSplitHeadWeight",
               "NativeInt8Weight", "NativeInt4Weight"}  # fmt: skip
    assert kinds <= allowed, kinds
    monkeypatch.setattr(native_weights, "native_ops", lambda: None)
    reference_tokens, _ = run()
    assert native == reference_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [576, 1536, 13])
def test_fused_rms_norm_and_silu_mul_vs_torch_and_fp64(lib, dtype, h):
    """The flat decoder's fused small ops: within fp32 rounding (one output rounding) of fp64
    and of the torch ops they replace."""
    from ops.norm import rms_norm

    torch.manual_seed(h)
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-20
    x, w = (torch.randn(3, h) * 3).to(dtype), torch.randn(h).to(dtype)
    x64 = x.double()
    want64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    got = lib.rms_norm(x, w, 1e-5)
    assert ((got.double() - want64).abs() <= ulp * want64.abs() + 1e-6).all()
    torch.testing.assert_close(got, rms_norm(x, w, 1e-5), rtol=2 * ulp, atol=1e-5)
    gate_up = (torch.randn(3, 2 * h) * 4).to(dtype)
    g, u = gate_up.double().chunk(2, dim=-1)
    want64 = g * torch.sigmoid(g) * u
    got = lib.silu_mul(gate_up)
    assert ((got.double() - want64).abs() <= ulp * want64.abs() + 1e-6).all()


@pytest.mark.parametrize("h", [576, 13])
def test_bf16_outputs_are_the_fp32_results_rounded_like_torch(lib, h):
    """The small ops' bf16 outputs (rounded in registers, 8 at a time; the tail one by one) are
    their fp32 results (the same template on the widened inputs) rounded by torch's .to(bf16):
    bit for bit, infinities and signed zeros included; NaN where torch has NaN (its payload
    bits differ between torch's own conversions)."""

    def same_bits(a, b):
        nan = a.isnan()
        assert torch.equal(nan, b.isnan())
        assert torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])

    torch.manual_seed(h)
    x, w = (torch.randn(4, h) * 3).bfloat16(), torch.randn(h).bfloat16()
    x[1, 3], x[2, 5], x[3] = float("nan"), float("inf"), x[3] * 2.0**100  # NaN, inf, huge rows
    got = lib.rms_norm(x, w, 1e-5)
    same_bits(got, lib.rms_norm(x.float(), w.float(), 1e-5).bfloat16())
    gate_up = (torch.randn(4, 2 * h) * 4).bfloat16()
    gate_up[0, 1], gate_up[1, h + 2], gate_up[2] = float("nan"), float("-inf"), 3e38
    got = lib.silu_mul(gate_up)
    same_bits(got, lib.silu_mul(gate_up.float()).bfloat16())
    # exact ties: silu(68) is 68 in fp32, so each output is the fp32 product 68 * u, which for
    # some u in [1, 2) lies halfway between two bf16 values (round to even, not up)
    u = 1.0 + torch.arange(128) / 128.0
    gate_up = torch.cat([torch.full((128,), 68.0), u]).bfloat16().view(1, -1)
    product = (68.0 * u).view(torch.int32)
    assert ((product & 0xFFFF) == 0x8000).sum() >= 4  # ties present (7)
    same_bits(lib.silu_mul(gate_up), lib.silu_mul(gate_up.float()).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row_lens,d", [((9, 1, 5), 64), ((700, 1, 263), 64), ((300, 17), 72)])
def test_decode_attention_writes_the_pool_and_matches_fp64(lib, dtype, row_lens, d):
    """Rows of different lengths over scattered pool slots: the rotated k and v land in their
    write slots, and the output is fp64 softmax attention over each row's first kv_len keys.
    Long rows span several 256-key chunks (merged) and 8-key score blocks with a tail; D = 72 has
    a part past the 64 values the V sum keeps in registers."""
    from ops.rope import rope_tables, rotate

    torch.manual_seed(0)
    b, hq, hkv, s_max = len(row_lens), 6, 2, max(row_lens)
    pool_size = b * s_max + 7
    lens = torch.tensor(row_lens)
    slots = torch.randperm(pool_size)[: b * s_max].view(b, s_max)  # [B, S], distinct
    write = slots[torch.arange(b), lens - 1]  # the new token: each row's last key
    pool_k, pool_v = (torch.randn(pool_size, hkv, d).to(dtype) for _ in range(2))
    qkv = torch.randn(b, (hq + 2 * hkv) * d).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_tables((lens - 1)[:, None], inv_freq, 1.0, dtype)  # [B, 1, 1, D]
    want_k, want_v = pool_k.clone(), pool_v.clone()
    rotated = rotate(qkv.view(b, 1, hq + 2 * hkv, d)[:, :, : hq + hkv], cos, sin)[:, 0]
    want_k[write], want_v[write] = rotated[:, hq:], qkv.view(b, -1, d)[:, hq + hkv :]
    got = lib.decode_attention(qkv, cos.reshape(b, d).contiguous(), sin.reshape(b, d).contiguous(),
                               pool_k, pool_v, write, slots.reshape(-1).contiguous(), lens, hq, hkv,
                               0.125)  # fmt: skip
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-20
    # one rounding of x * cos + x2 * sin here, three in torch's bf16 `rotate`: an ulp of |x|
    torch.testing.assert_close(pool_k, want_k, rtol=ulp, atol=8 * ulp)
    assert torch.equal(pool_v, want_v)
    for i in range(b):
        keys = want_k[slots[i, : lens[i]]].double()  # [S, Hkv, D]
        values = want_v[slots[i, : lens[i]]].double()
        for h in range(hq):
            q = rotated[i, h].double()
            p = torch.softmax(keys[:, h // (hq // hkv)] @ q * 0.125, dim=0)
            want = p @ values[:, h // (hq // hkv)]
            err = (got[i, h * d : (h + 1) * d].double() - want).abs()
            # bf16: q and k differ by an ulp of rounding (above), the output by half an ulp
            assert (err <= 2 * ulp * want.abs() + 4 * ulp).all(), (i, h, err.max())
