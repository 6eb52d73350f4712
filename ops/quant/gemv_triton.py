"""CUDA: one-row / few-row weight-only matmul (GEMV) for 1-byte weights, fp8 (e4m3) or int8, with
per-output-channel scales: out[M, N] = (x[M, K] @ w[N, K].T) * s[N], x unquantized (or fp8
with 2-D block scales, applied per slice); and, with no scale (HAS_SCALE False), for plain bf16
weights: the batch-1 decode linears of ops/linear.py, out = x @ w.T (+ bias), where cuBLAS's
GEMV streamed the small decode matrices at 1.4-2.4 TB/s of the H200's ~4.2.

Why a GEMV and not a tiled matmul: at decode (M <= a few rows) the product is bound by streaming
the weight once, and a tensor-core tile (M padded to 16) leaves each program few bytes in flight.
Here a program owns BLOCK_N output channels and a 1/SPLIT_K share of their rows, walked in
BLOCK_K slices: [BLOCK_N, BLOCK_K] 1-byte loads, 16 contiguous bytes per thread (rows are
K-contiguous), upcast to fp32 in registers, times the fp32 rows of x (every program reads the
same x, from L2), fp32 accumulation; one row's products stay element-wise until the loop ends
(one reduction per program), several rows reduce each slice. The scale multiplies the fp32 sum
once per channel. The next slice is loaded before the current one is used (two in flight per
program). Measured at one row (H200): 0.54-0.72 of the copy bandwidth on the large matrices,
0.13-0.44 on the small, launch-bound ones (docs/performance-log.md, 2026-12-02).

Split-K (for narrow N with few programs; it won the narrow shapes at 2-8 rows, none at one row):
each program writes its fp32 partial sums to a workspace and bumps its column block's counter;
the last of the SPLIT_K programs to arrive adds the partials (in split order, so the result does
not depend on who arrives last), scales, writes the output and resets the counter to 0 for the
next call. One launch, no memset, no second pass. The workspace and counters are allocated once
per device (outside graph capture; a call captured before any eager call runs unsplit), so split
calls on one device must be ordered (one stream, as the engine's steps are), never concurrent.
No host sync; the grid depends on N and M only, so CUDA graphs capture it.

The tensor-core loop (DOT, `_accumulate_dot`): the same tiles fed to tl.dot as fp16 (1-byte
weights) or bf16 slices against x as 16 columns, one per row. The FMA loop above costs ~4.6
sm_90 instructions a weight and is issue-bound on the H200's bandwidth; the dot is not (the
wide one-row fp8 shapes 1.10-1.14x faster, gemv_tiles.FP8_READS). Under PDL (ops/pdl.py) either
loop loads its first weight slice, then waits for the previous kernel, then reads x (PRELOAD).

Tiles (BLOCK_N, BLOCK_K, num_warps, SPLIT_K) per shape come from ops/quant/gemv_tiles.py (measured
on the H200 by tools/bench_fp8_linear.py's sweep, bf16 by tools/bench_gemv.py's, with a rule for
shapes not measured).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ops.pdl import launch_args
from ops.pdl_triton import pdl_enter, pdl_prefetch_enter
from ops.quant.fp8 import E4M3_F32_MASK, E4M3_F32_UNBIAS
from ops.quant.gemv_epilogue import RopeKvTarget, store, tile_rows
from ops.quant.gemv_tiles import (
    bf16_takes_dot,
    block_rows,
    dot_stages,
    fp8_bits_mode,
    fp8_reads_raw,
    fp8_takes_bits,
    fp8_takes_dot,
    pick_bf16_config,
    pick_config,
    prefetch_lines,
    preload_mode,
)

WORKSPACE_FLOATS = 2**22  # fp32 partials [SPLIT_K, BLOCK_M, N] of one split call (16 MiB)
MAX_COUNTERS = 2**16  # column blocks of one split call
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
# 1-byte weights: convert each slice to fp16 as it is loaded instead of carrying the raw bytes
# across the loop (the sm_90 SASS re-pairs carried fp8 bytes: 103 -> 78 instructions per 16
# weight bytes per thread at the 8 x 256 tile, read offline). Exact either way (e4m3 and int8
# are fp16 values). Timed on an H200, fp8 batch-1 decode, one call each: Llama-1B 1,139 vs
# 1,084 tok/s (12-03 13:39), Llama-8B 307.4 vs 284.9 / 285.0 (12-03 20:35): the default. Read once.
ENV_WIDEN = "TORCH_RUNNER_GEMV_WIDEN"  # "1" (default): widen, "0": carry the raw bytes
_widen_raw = os.environ.get(ENV_WIDEN, "1").strip()
if _widen_raw not in ("0", "1"):
    raise ValueError(f"{ENV_WIDEN}={_widen_raw!r}: allowed values are 0 and 1")
WIDEN_1BYTE = _widen_raw == "1"
FP8_BITS_MODE = fp8_bits_mode()  # where e4m3 is read by bit placement (gemv_tiles); read once
# PDL launches (ops/pdl.py): 128-byte lines of each weight row a program asks L2 for before it
# waits for the previous kernel (0: none)
PREFETCH_LINES = prefetch_lines()  # read once
PRELOAD = preload_mode() == "on"  # the first weight slice before the PDL wait; read once


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
    return _convert(w, WIDEN, E4M3_BITS), x


@triton.jit
def _convert(w, WIDEN: tl.constexpr, E4M3_BITS: tl.constexpr):
    """A loaded weight slice as the loop carries it (_load_slice)."""
    if WIDEN:
        w = w.to(tl.float16)
    if E4M3_BITS:
        w = _e4m3_bits_f32(w)
    return w


@triton.jit
def _first_slice(w_ptrs, x_ptrs, cols, n_ok, m_ok, K, ok, EVEN_K: tl.constexpr,
                 WIDEN: tl.constexpr, E4M3_BITS: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """_load_slice of the first slice with its weights loaded before the PDL wait (pdl_enter):
    no kernel writes weights, so their bytes stream in while the previous kernel finishes; x,
    which the previous kernel writes, only after it."""
    if EVEN_K:
        w = tl.load(w_ptrs, mask=n_ok[:, None] & ok)
    else:
        w = tl.load(w_ptrs, mask=n_ok[:, None] & (cols < K)[None, :] & ok)
    pdl_enter(PDL)
    if EVEN_K:
        x = tl.load(x_ptrs, mask=m_ok[:, None] & ok, other=0.0)
    else:
        x = tl.load(x_ptrs, mask=m_ok[:, None] & (cols < K)[None, :] & ok, other=0.0)
    return _convert(w, WIDEN, E4M3_BITS), x


@triton.jit
def _accumulate(x_ptr, w_ptr, s_ptr, rn, rm, n_ok, m_ok, K, k_split, stride_xm, stride_wn,
                stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_BN: tl.constexpr,
                SCALE_BK: tl.constexpr, WIDEN: tl.constexpr, E4M3_BITS: tl.constexpr,
                PRELOAD: tl.constexpr = False, PDL: tl.constexpr = False):  # fmt: skip
    """This program's fp32 sums [BLOCK_M, BLOCK_N] over its split of K (block scales applied
    per slice); E4M3_BITS: the weights read by bit placement, the sums still carry 2^-60.
    PRELOAD: the PDL wait happens here, after the first slice's weight loads (_first_slice)."""
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
    if PRELOAD:
        w_next, x_next = _first_slice(w_ptrs, x_ptrs, rk, n_ok, m_ok, K, k_split > 0, EVEN_K,
                                      WIDEN, E4M3_BITS, PDL)  # fmt: skip
    else:
        w_next, x_next = _load_slice(w_ptrs, x_ptrs, rk, n_ok, m_ok, K, k_split > 0, EVEN_K,
                                     WIDEN, E4M3_BITS)  # fmt: skip
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
def _dot_slice(w, x, acc):
    """acc + w @ x on the tensor cores: bf16 weights as they are, 1-byte ones as fp16 (exact)."""
    if w.dtype == tl.bfloat16:
        return tl.dot(w, x.to(tl.bfloat16), acc)
    return tl.dot(w.to(tl.float16), x.to(tl.float16), acc)


@triton.jit
def _dot_loop(w_ptrs, x_ptrs, n_ok, x_ok, acc, start, k_split, BLOCK_K: tl.constexpr):
    """acc + the slices from column `start` to `k_split` of this program's split (pipelined)."""
    for _k0 in range(start, k_split, BLOCK_K):
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        acc = _dot_slice(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _accumulate_dot(x_ptr, w_ptr, rn, n_ok, M, k_split, stride_xm, stride_wn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRELOAD: tl.constexpr = False, PDL: tl.constexpr = False):  # fmt: skip
    """This program's fp32 sums [BLOCK_M, BLOCK_N] on the tensor cores: [BLOCK_N, BLOCK_K]
    weight slices (1-byte ones converted to fp16 as loaded, exact) times x as [BLOCK_K, 16]
    columns, column m holding row m (x converted to the slice's dtype: exact for bf16 x in
    fp16's normal range; |x| > 65504 gives inf, which the caller reruns); whole slices only
    (EVEN_K). The dot pays 16 columns for one row, but the tensor cores have the rate to spare;
    what it saves is the per-weight multiply-add and fp32 widening of the FMA loop. PRELOAD:
    the first slice is taken out of the loop, its weights loaded before the PDL wait (here) and
    its x after, and multiplied first (the same sums in the same order); the loop, which Triton
    pipelines, starts at the second. Multiplied after the loop instead, so that the pipeline's
    first loads are not held up behind it, it was no faster (H100, Llama-8B fp8 batch 1: 314.7
    against 315.3 tok/s, other tokens)."""
    pid_k = tl.program_id(1)
    rk = pid_k * k_split + tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 16)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + cols[None, :] * stride_xm + rk[:, None]  # [BLOCK_K, 16]
    x_ok = (cols < M)[None, :]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    if PRELOAD:  # k_split >= BLOCK_K (whole slices, dot_fits)
        w0 = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        pdl_enter(PDL)
        acc = _dot_slice(w0, tl.load(x_ptrs, mask=x_ok, other=0.0), acc)
        acc = _dot_loop(w_ptrs + BLOCK_K, x_ptrs + BLOCK_K, n_ok, x_ok, acc, BLOCK_K, k_split,
                        BLOCK_K)  # fmt: skip
    else:
        acc = _dot_loop(w_ptrs, x_ptrs, n_ok, x_ok, acc, 0, k_split, BLOCK_K)
    rm = tl.arange(0, BLOCK_M)
    out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m in tl.static_range(BLOCK_M):  # row m of the product is column m of acc
        col = tl.sum(tl.where(cols[None, :] == m, acc, 0.0), axis=1)
        out = tl.where(rm[:, None] == m, col[None, :], out)
    return out


@triton.jit
def _gemv(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, k_split, stride_xm,
          stride_wn, stride_om, stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
          HAS_SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
          HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr, E4M3_BITS: tl.constexpr = False,
          DOT: tl.constexpr = False, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
          LINE: tl.constexpr = 128, GATED: tl.constexpr = False, cos_ptr=None, sin_ptr=None,
          slots_ptr=None, k_ptr=None, v_ptr=None, stride_ct=0, stride_st=0, stride_slot=0,
          stride_ks=0, stride_kh=0, stride_vs=0, stride_vh=0, ROPE: tl.constexpr = False,
          HQ: tl.constexpr = 0, HKV: tl.constexpr = 0, HALF: tl.constexpr = 1,
          PRELOAD: tl.constexpr = False):  # fmt: skip
    # HAS_SCALE False: a plain (bf16 / fp16) weight, no scale (s_ptr unused). SCALE_BK == 0: one
    # scale per channel, s[N]; else one per (SCALE_BN, SCALE_BK) block, s[ceil(N / SCALE_BN),
    # ceil(K / SCALE_BK)] (row stride stride_sn), BLOCK_K dividing SCALE_BK. HAS_BIAS: + b[N]
    # in fp32 before the one rounding to the output dtype (as cuBLAS's bias epilogue). GATED: w is
    # [gate | up] (N = 2I rows); a program takes BLOCK_N / 2 channels of each, gate and up rows
    # interleaved in its tile, and stores silu(gate) * up [M, I] of its rounded sums. ROPE: w is
    # [q | k | v] heads of 2 HALF rows; a program takes (d, d + HALF) row pairs, rotates q and k,
    # stores q [M, HQ * 2 HALF] and writes k and v to the pools (ops/quant/gemv_epilogue.py)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn, n_ok = tile_rows(pid_n, N, BLOCK_N, GATED, ROPE, HALF)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    out_ok = m_ok[:, None] & n_ok[None, :]
    preload = PRELOAD and PREFETCH == 0  # then the loop waits for the previous kernel itself
    if PREFETCH > 0:  # PDL: the first PREFETCH 128-byte lines of each weight row into L2 first
        lines = pid_k * k_split + tl.arange(0, PREFETCH) * LINE
        rows = tl.minimum(rn, N - 1).to(tl.int64)
        pdl_prefetch_enter(w_ptr + rows[:, None] * stride_wn + lines[None, :], PDL)
    elif not preload:
        pdl_enter(PDL)
    if DOT:
        acc = _accumulate_dot(x_ptr, w_ptr, rn, n_ok, M, k_split, stride_xm, stride_wn, BLOCK_M,
                              BLOCK_N, BLOCK_K, preload, PDL)  # fmt: skip
    else:
        acc = _accumulate(x_ptr, w_ptr, s_ptr, rn, rm, n_ok, m_ok, K, k_split, stride_xm,
                          stride_wn, stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, HAS_SCALE,
                          SCALE_BN, SCALE_BK, WIDEN and not E4M3_BITS, E4M3_BITS, preload,
                          PDL)  # fmt: skip
    if E4M3_BITS:
        acc = acc * E4M3_UNBIAS
    if E4M3_BITS or DOT:
        bad = tl.where(out_ok & ~(tl.abs(acc) < INF), 1, 0)  # x * 2^60 or fp16 x overflowed?
        if tl.max(tl.max(bad, axis=1), axis=0) > 0:  # the same slices through WIDEN (rare)
            acc = _accumulate(x_ptr, w_ptr, s_ptr, rn, rm, n_ok, m_ok, K, k_split, stride_xm,
                              stride_wn, stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, HAS_SCALE,
                              SCALE_BN, SCALE_BK, True, False)  # fmt: skip
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    if HAS_SCALE and SCALE_BK == 0:
        scale = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    else:
        scale = 1.0  # no scale, or block scales applied per slice above
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    else:
        bias = 0.0
    if SPLIT_K == 1:
        store(out_ptr, out_ptrs, acc * scale + bias, out_ok, pid_n, rm, m_ok, N, stride_om,
              cos_ptr, sin_ptr, slots_ptr, k_ptr, v_ptr, stride_ct, stride_st, stride_slot,
              stride_ks, stride_kh, stride_vs, stride_vh, BLOCK_M, BLOCK_N, GATED, ROPE, HQ,
              HKV, HALF)  # fmt: skip
    else:
        ws = ws_ptr + rm[:, None] * N + rn[None, :]  # split s at ws + s * BLOCK_M * N
        tl.store(ws + pid_k * BLOCK_M * N, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partials stored before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last program of this column block
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # split order: the same sum whoever arrives last
                total += tl.load(ws + s * BLOCK_M * N, mask=out_ok, other=0.0, cache_modifier=".cg")
            store(out_ptr, out_ptrs, total * scale + bias, out_ok, pid_n, rm, m_ok, N,
                  stride_om, cos_ptr, sin_ptr, slots_ptr, k_ptr, v_ptr, stride_ct, stride_st,
                  stride_slot, stride_ks, stride_kh, stride_vs, stride_vh, BLOCK_M, BLOCK_N,
                  GATED, ROPE, HQ, HKV, HALF)  # fmt: skip
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # for the next call


def block_slices(block_n: int, block_k: int, scale_bk: int) -> tuple[int, int]:
    """A per-channel tile reshaped for block scales: slices no wider than (and dividing) the
    scale block's columns, with more channels so a slice keeps its bytes (and registers)."""
    narrow = min(block_k, scale_bk & -scale_bk)  # the largest power of two dividing scale_bk
    return block_n * (block_k // narrow), narrow


def dot_fits(block_n: int, block_k: int, k_split: int) -> bool:
    """Whether a tile can run the tensor-core loop: whole slices of 16+ channels and columns
    (block scales and x other than bf16 / fp16 are ruled out before the tile is picked)."""
    return block_n >= 16 and block_k >= 16 and k_split % block_k == 0


def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The device's split-K partials and counters (zeroed once; the kernel resets them), or None
    inside a graph capture before any eager call made them (capture memory is the graph's)."""
    found = _workspaces.get(device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if found is None and not capturing:
        found = (torch.empty(WORKSPACE_FLOATS, dtype=torch.float32, device=device),
                 torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device))  # fmt: skip
        _workspaces[device] = found
    return found


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    config=None,
    block=None,
    bias: torch.Tensor | None = None,
    widen: bool | None = None,
    bits: bool | None = None,
    dot: bool | None = None,
    stages: int | None = None,
    gated: bool = False,
    rope: RopeKvTarget | None = None,
    preload: bool | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32, M <= MAX_ROWS) @ weight [N, K].T (row-major) times
    scale [N] (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation. weight: e4m3 or int8 with
    a scale, or a plain weight in x's dtype with scale None (the bf16 decode GEMV, ops/linear.py).
    block (bn, bk): scale holds one fp32 value per (bn, bk) block of the weight, [ceil(N / bn),
    ceil(K / bk)] (fp8 checkpoints' `weight_block_size`). config: (BLOCK_N, BLOCK_K, num_warps,
    SPLIT_K) to override the table (the fp8 / int8 one, or the bf16 one when scale is None).
    widen: carry 1-byte weight slices as fp16 (default WIDEN_1BYTE, unless one row of an fp8
    shape measured faster carrying raw bytes: gemv_tiles.FP8_READS; ignored for 2-byte ones).
    bits: read e4m3 weights by bit placement at one row (default: gemv_tiles.fp8_takes_bits under
    FP8_BITS_MODE); False for weights holding e4m3 NaN bytes, which it would read as 480;
    ignored for other weights and for 2+ rows.
    dot: run the slices through the tensor cores (_accumulate_dot) where the tile allows (whole
    slices, BLOCK_N and BLOCK_K >= 16, per-channel or no scale, bf16 / fp16 x); default: where
    the tables say (gemv_tiles.fp8_takes_dot / bf16_takes_dot). stages: Triton's num_stages
    for that loop (default: the table's, else Triton's). gated: weight (and scale, bias) hold
    [gate | up] rows, [2I, K]: the result is silu(gate) * up, [M, I], with the values of this
    product followed by ops.activation.silu_mul (a feed-forward's gate/up projection without the
    SiLU-mul kernel); each program takes half its tile's channels from each half. rope: weight
    is a [q | k | v] projection of full-rotary heads; returns the rotated q [M, Hq * D] and
    writes k and v to rope's pools, the values of this product followed by ops.rope.rope_kv_write
    (the rope + KV-write kernel fewer; ops/quant/gemv_epilogue.py). preload: the first weight
    slice is loaded before the PDL wait, in either loop (default: TORCH_RUNNER_GEMV_PRELOAD)."""
    m, k = x.shape
    n = weight.shape[0]
    if gated and n % 2:
        raise ValueError(f"gemv: gated needs [gate | up] rows, an even count; weight has {n}")
    if rope is not None:
        if gated:
            raise ValueError("gemv: gated and rope are two epilogues; pass one")
        rope.check(x, n)
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_m = block_rows(m)
    plain = scale is None
    if dot is None:
        e4m3 = weight.dtype == torch.float8_e4m3fn
        dot = bf16_takes_dot(m, n, k) if plain else e4m3 and fp8_takes_dot(m, n, k)
    dot = dot and block is None and x.dtype in (torch.bfloat16, torch.float16)
    if config is None and not plain:  # a table tile made for the dot only where it runs
        config = pick_config(m, n, k, int8=weight.dtype == torch.int8, dot=dot)
    block_n, block_k, warps, split = config or pick_bf16_config(m, n, k)
    scale_bn, scale_bk = block or (0, 0)
    if block is not None:
        block_n, block_k = block_slices(block_n, block_k, scale_bk)
    paired = gated or rope is not None
    if paired:
        block_n = max(block_n, 2)  # a (gate, up) / (d, d + D / 2) pair at least
    num_blocks = triton.cdiv(n // 2, block_n // 2) if paired else triton.cdiv(n, block_n)
    if k % (split * block_k) or split * block_m * n > WORKSPACE_FLOATS or num_blocks > MAX_COUNTERS:
        split = 1  # the split path needs whole slices per split and room for its partials
    ws = _workspace(x.device) if split > 1 else None
    if ws is None:
        split, ws = 1, (x, x)  # unused by the unsplit kernel
    width = n // 2 if gated else n if rope is None else rope.num_q_heads * rope.k_pool.shape[2]
    out = torch.empty((m, width), dtype=x.dtype, device=x.device)
    k_split = k // split if split > 1 else k
    dot = dot and dot_fits(block_n, block_k, k_split)
    stages = stages or (dot_stages(m, n, k, plain) if dot else None)
    extra = launch_args(x.device)
    if stages is not None:
        extra["num_stages"] = stages
    if rope is not None:  # no FMA contraction: on sm_90 it reached rope's products through the
        # bf16 rounding between them (H200, 12-07: 479 of 2,048 q values 1 ulp off the rope
        # kernel's, none without it; 1B batch-1 decode then token-identical and 0.3-0.7% faster)
        extra.update(rope.launch_args(), enable_fp_fusion=False)
    if extra["PDL"] and PREFETCH_LINES:
        span = k_split * weight.element_size() // 128  # whole lines in this program's split
        extra.update(PREFETCH=min(PREFETCH_LINES, 1 << max(span, 1).bit_length() - 1) if span else 0,
                     LINE=128 // weight.element_size())  # fmt: skip
    _gemv[(num_blocks, split)](x, weight, x if scale is None else scale,
                               x if bias is None else bias, out, *ws, m, n, k, k_split,
                               x.stride(0), weight.stride(0), out.stride(0),
                               0 if scale is None else scale.stride(0), BLOCK_M=block_m,
                               BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                               EVEN_K=k_split % block_k == 0, HAS_SCALE=scale is not None,
                               SCALE_BN=scale_bn, SCALE_BK=scale_bk, HAS_BIAS=bias is not None,
                               WIDEN=weight.element_size() == 1 and (widen if widen is not None
                               else WIDEN_1BYTE and not (weight.dtype == torch.float8_e4m3fn
                                                         and fp8_reads_raw(m, n, k))),
                               E4M3_BITS=not dot and block_m == 1
                               and weight.dtype == torch.float8_e4m3fn
                               and (fp8_takes_bits(m, n, k, FP8_BITS_MODE) if bits is None
                                    else bits),
                               DOT=dot, GATED=gated, num_warps=warps,
                               PRELOAD=PRELOAD if preload is None else preload,
                               **extra)  # fmt: skip
    return out
