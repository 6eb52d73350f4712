"""The per-slice loops of the one-row / few-row GEMV (ops/quant/gemv_triton.py, which documents
the design): the FMA loop over [BLOCK_N, BLOCK_K] weight slices (1-byte weights widened as loaded,
or e4m3 by bit placement), the tensor-core loop, and its paired form for gated products. Triton
device functions only; the kernel and its launcher live in gemv_triton.py."""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ops.quant.fp8 import E4M3_F32_MASK, E4M3_F32_UNBIAS

# e4m3 weights by bit placement (E4M3_BITS, one row): the sign-extended byte shifted left 20 and
# masked to 0x87F00000 is an fp32 whose value is the e4m3 value * 2^-120, subnormals included
# (e4m3 subnormals land on fp32 subnormals; Triton's fp32 FMA keeps them: no .ftz in its PTX):
# three integer ops a weight instead of two conversions (e4m3x2 -> f16x2, f16 -> f32). x is
# multiplied by 2^60 as loaded and the sum by 2^60 after the loop, both exact powers of two, so
# the products are WIDEN's, unless |w * x| < 2^-66 (then subnormal: an absolute error under 2^-89
# a product, before the scale) or |x| > 2^68 (x * 2^60 overflows): a program whose scaled sums
# are not all finite runs its slices again through WIDEN, so huge, infinite and NaN activations
# give what WIDEN gives. e4m3 NaN bytes (0x7F / 0xFF) would read as 480: weights holding them
# must not take this path (Fp8Weight checks once, at load). Measured slower than WIDEN on every
# Llama shape on the H200 (2-30% in a CUDA-graph chain, 2026-12-04: the loop is bound by issue,
# not by the conversion unit), so only the table's FP8_READS or TORCH_RUNNER_GEMV_FP8_BITS=on
# select it.
E4M3_MASK = tl.constexpr(E4M3_F32_MASK - 2**32)  # as int32: bit 31 and bits 20-26
E4M3_UNBIAS = tl.constexpr(2.0 ** (E4M3_F32_UNBIAS // 2))  # x * 2^60, sum * 2^60: the 2^-120
INF = tl.constexpr(float("inf"))
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")  # it has no bf16 scalars


@triton.jit
def _e4m3_bits_f32(w):
    """e4m3 bytes (any 1-byte type) -> fp32 e4m3 value * 2^-120, integer ops only (the torch
    twin: ops.quant.fp8.e4m3_bits_reference)."""
    b = w.to(tl.int8, bitcast=True).to(tl.int32)  # sign-extended: the sign's copies in 27-31
    return ((b << 20) & E4M3_MASK).to(tl.float32, bitcast=True)


@triton.jit
def _load_slice(w_ptrs, x_ptrs, cols, n_ok, m_ok, K, ok, EVEN_K: tl.constexpr,
                WIDEN: tl.constexpr, E4M3_BITS: tl.constexpr):  # fmt: skip
    """One [BLOCK_N, BLOCK_K] weight slice and its [BLOCK_M, BLOCK_K] rows of x, raw (1-byte
    weights stay packed in registers until used) or, WIDEN, 1-byte weights converted to fp16
    as loaded (exact for e4m3 and int8), or E4M3_BITS, e4m3 as fp32 * 2^-120 as loaded (7.3-7.7
    sm_90 instructions a weight in the loop, 7.8-8.1 converted at use); ok False loads nothing
    (past the split)."""
    if EVEN_K:  # rows past N load nothing and are never stored
        w = tl.load(w_ptrs, mask=n_ok[:, None] & ok)
        x = tl.load(x_ptrs, mask=m_ok[:, None] & ok, other=0.0)
    else:
        k_ok = (cols < K)[None, :] & ok
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok)
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok, other=0.0)
    if WIDEN:
        w = w.to(tl.float16)
    if E4M3_BITS:
        w = _e4m3_bits_f32(w)
    return w, x


@triton.jit
def _accumulate(x_ptr, w_ptr, s_ptr, rn, rm, n_ok, m_ok, K, k_split, stride_xm, stride_wn,
                stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_BN: tl.constexpr,
                SCALE_BK: tl.constexpr, WIDEN: tl.constexpr, E4M3_BITS: tl.constexpr):  # fmt: skip
    """This program's fp32 sums [BLOCK_M, BLOCK_N] over its split of K (block scales applied
    per slice); E4M3_BITS: the weights read by bit placement, the sums still carry 2^-60."""
    pid_k = tl.program_id(1)
    rk = pid_k * k_split + tl.arange(0, BLOCK_K)  # k_split: a multiple of BLOCK_K (host)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K]
    if E4M3_BITS:  # x read again for every weight row, [BLOCK_N, BLOCK_K], in the weights'
        # layout (one row, E4M3_BITS only): from [1, BLOCK_K] Triton moved the converted
        # weights through shared memory to x's layout every slice (seen in the sm_90 SASS)
        x_ptrs = x_ptr + (rn * 0)[:, None] + rk[None, :]
    else:
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
    if BLOCK_M == 1:
        acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # register double buffering: the next slice's loads are issued before this slice's math, so
    # each program keeps two tiles in flight (Triton's pipeliner leaves loads that feed no dot
    # alone: num_stages changes nothing here, seen in the SASS)
    w_next, x_next = _load_slice(w_ptrs, x_ptrs, rk, n_ok, m_ok, K, k_split > 0, EVEN_K, WIDEN,
                                 E4M3_BITS)  # fmt: skip
    for k0 in range(0, k_split, BLOCK_K):
        w, x = w_next, x_next
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_next, x_next = _load_slice(w_ptrs, x_ptrs, rk + k0 + BLOCK_K, n_ok, m_ok, K,
                                     k0 + BLOCK_K < k_split, EVEN_K, WIDEN, E4M3_BITS)  # fmt: skip
        wf = w.to(tl.float32)
        if E4M3_BITS and x.dtype == tl.bfloat16 and not INTERPRETED:  # packed bf16 multiply
            xf = (x * E4M3_UNBIAS).to(tl.float32)  # a bf16 product (weak scalar)
        elif E4M3_BITS:  # fp16 x * 2^60 would overflow: in fp32 (the same exact values)
            xf = x.to(tl.float32) * E4M3_UNBIAS
        else:
            xf = x.to(tl.float32)
        if HAS_SCALE and SCALE_BK > 0:  # a slice inside one block column: a scale per row
            kb = (pid_k * k_split + k0) // SCALE_BK
            s_blk = tl.load(s_ptr + (rn // SCALE_BN) * stride_sn + kb, mask=n_ok, other=0.0)
            wf = wf * s_blk[:, None]
        if not EVEN_K:  # columns past K: zero weights (an unloaded lane may read as a NaN)
            wf = tl.where((rk + k0 < K)[None, :], wf, 0.0)
        if BLOCK_M == 1:
            acc1 += wf * xf  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]: reduced once, after the loop
        else:
            acc += tl.sum(xf[:, None, :] * wf[None, :, :], axis=2)
    if BLOCK_M == 1:
        acc = tl.sum(acc1, axis=1)[None, :]  # [1, BLOCK_N]
    return acc


@triton.jit
def _accumulate_dot(x_ptr, w_ptr, rn, n_ok, M, k_split, stride_xm, stride_wn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """This program's fp32 sums [BLOCK_M, BLOCK_N] on the tensor cores: [BLOCK_N, BLOCK_K]
    weight slices (1-byte ones converted to fp16 as loaded, exact) times x as [BLOCK_K, 16]
    columns, column m holding row m (x converted to the slice's dtype: exact for bf16 x in
    fp16's normal range; |x| > 65504 gives inf, which the caller reruns); whole slices only
    (EVEN_K). The dot pays 16 columns for one row, but the tensor cores have the rate to spare;
    what it saves is the per-weight multiply-add and fp32 widening of the FMA loop."""
    pid_k = tl.program_id(1)
    rk = pid_k * k_split + tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 16)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + cols[None, :] * stride_xm + rk[:, None]  # [BLOCK_K, 16]
    x_ok = (cols < M)[None, :]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for _k0 in range(0, k_split, BLOCK_K):
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        if w_ptr.dtype.element_ty == tl.bfloat16:
            acc = tl.dot(w, x.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(w.to(tl.float16), x.to(tl.float16), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return _dot_rows(acc, BLOCK_M, BLOCK_N)


@triton.jit
def _dot_rows(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N, 16] tensor-core sums (column m: row m of x) -> the product [BLOCK_M, BLOCK_N]."""
    cols = tl.arange(0, 16)
    rm = tl.arange(0, BLOCK_M)
    out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m in tl.static_range(BLOCK_M):  # row m of the product is column m of acc
        col = tl.sum(tl.where(cols[None, :] == m, acc, 0.0), axis=1)
        out = tl.where(rm[:, None] == m, col[None, :], out)
    return out


@triton.jit
def _accumulate_dot_paired(x_ptr, w_ptr, pair, n_ok, M, half, k_split, stride_xm, stride_wn,
                           BLOCK_M: tl.constexpr, HALF_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """GATED on the tensor cores: the gate rows `pair` and the up rows `pair + half` [HALF_N]
    in two accumulators, so the epilogue pairs gate and up channels in one layout (the
    interleaved tile needed a reshape and split, a trip through shared memory, per program)."""
    pid_k = tl.program_id(1)
    rk = pid_k * k_split + tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 16)
    g_ptrs = w_ptr + pair.to(tl.int64)[:, None] * stride_wn + rk[None, :]  # [HALF_N, BLOCK_K]
    u_ptrs = g_ptrs + half.to(tl.int64) * stride_wn
    x_ptrs = x_ptr + cols[None, :] * stride_xm + rk[:, None]  # [BLOCK_K, 16]
    x_ok = (cols < M)[None, :]
    acc_g = tl.zeros((HALF_N, 16), dtype=tl.float32)
    acc_u = tl.zeros((HALF_N, 16), dtype=tl.float32)
    for _k0 in range(0, k_split, BLOCK_K):
        wg = tl.load(g_ptrs, mask=n_ok[:, None], other=0.0)
        wu = tl.load(u_ptrs, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        if w_ptr.dtype.element_ty == tl.bfloat16:
            xd = x.to(tl.bfloat16)
            acc_g = tl.dot(wg, xd, acc_g)
            acc_u = tl.dot(wu, xd, acc_u)
        else:
            xd = x.to(tl.float16)
            acc_g = tl.dot(wg.to(tl.float16), xd, acc_g)
            acc_u = tl.dot(wu.to(tl.float16), xd, acc_u)
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return _dot_rows(acc_g, BLOCK_M, HALF_N), _dot_rows(acc_u, BLOCK_M, HALF_N)
