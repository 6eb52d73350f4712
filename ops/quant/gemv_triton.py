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
wide one-row fp8 shapes 1.10-1.14x faster, gemv_tiles.FP8_READS). Under PDL (ops/pdl.py) every
program asks L2 for the start of its weight rows, then waits for the previous kernel.

Gated (a feed-forward's [gate | up] weight, silu(gate) * up stored): a program takes BLOCK_N / 2
channels of each half. On the tensor cores with one split (PAIRED) the gate rows and the up rows
go to two accumulators, so the epilogue pairs channels in the accumulators' own layout; the FMA
loop interleaves gate and up rows in one tile and splits the pairs in the epilogue.

Tiles (BLOCK_N, BLOCK_K, num_warps, SPLIT_K) per shape come from ops/quant/gemv_tiles.py (measured
on the H200 by tools/bench_fp8_linear.py's sweep, bf16 by tools/bench_gemv.py's, with a rule for
shapes not measured).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ops.fused.triton_kernels import silu_mul_values
from ops.pdl import launch_args
from ops.pdl_triton import pdl_enter, pdl_prefetch_enter
from ops.quant.gemv_loops import (
    E4M3_UNBIAS,
    INF,
    _accumulate,
    _accumulate_dot,
    _accumulate_dot_paired,
)
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
ENV_PAIRED = "TORCH_RUNNER_GEMV_PAIRED"  # "1" (default): gated dot tiles in two accumulators
_paired_raw = os.environ.get(ENV_PAIRED, "1").strip()
if _paired_raw not in ("0", "1"):
    raise ValueError(f"{ENV_PAIRED}={_paired_raw!r}: allowed values are 0 and 1")
PAIRED_GATED = _paired_raw == "1"
# PDL launches (ops/pdl.py): 128-byte lines of each weight row a program asks L2 for before it
# waits for the previous kernel (0: none)
PREFETCH_LINES = prefetch_lines()  # read once


@triton.jit
def _paired_epilogue(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, pair, n_ok, rm, m_ok, M, N, K,
                     k_split, stride_xm, stride_wn, stride_om, stride_sn, BLOCK_M: tl.constexpr,
                     HALF_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """The paired GATED product (one split): the two accumulators, scaled (+ bias), rounded,
    silu(gate) * up stored [M, N / 2]; fp16 x that overflowed reruns through WIDEN (rare)."""
    half = N // 2
    up = pair + half
    acc_g, acc_u = _accumulate_dot_paired(x_ptr, w_ptr, pair, n_ok, M, half, k_split, stride_xm,
                                          stride_wn, BLOCK_M, HALF_N, BLOCK_K)  # fmt: skip
    ok = m_ok[:, None] & n_ok[None, :]
    bad = tl.where(ok & ~((tl.abs(acc_g) < INF) & (tl.abs(acc_u) < INF)), 1, 0)
    if tl.max(tl.max(bad, axis=1), axis=0) > 0:
        acc_g = _accumulate(x_ptr, w_ptr, s_ptr, pair, rm, n_ok, m_ok, K, k_split, stride_xm,
                            stride_wn, stride_sn, BLOCK_M, HALF_N, BLOCK_K, EVEN_K, HAS_SCALE,
                            0, 0, True, False)  # fmt: skip
        acc_u = _accumulate(x_ptr, w_ptr, s_ptr, up, rm, n_ok, m_ok, K, k_split, stride_xm,
                            stride_wn, stride_sn, BLOCK_M, HALF_N, BLOCK_K, EVEN_K, HAS_SCALE,
                            0, 0, True, False)  # fmt: skip
    if HAS_SCALE:
        acc_g *= tl.load(s_ptr + pair, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u *= tl.load(s_ptr + up, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + pair, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + up, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    value = silu_mul_values(acc_g.to(dtype), acc_u.to(dtype), dtype)
    tl.store(out_ptr + rm[:, None] * stride_om + pair[None, :], value, mask=ok)


@triton.jit
def _store(out_ptr, out_ptrs, value, out_ok, pid_n, rm, m_ok, N, stride_om, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, GATED: tl.constexpr):  # fmt: skip
    """The fp32 results rounded to the output dtype, stored; GATED: [gate, up] pairs of columns
    rounded, then silu(gate) * up (ops.activation.silu_mul's rounding) into out [M, N / 2]."""
    value = value.to(out_ptr.dtype.element_ty)
    if GATED:
        gate, up = tl.split(tl.reshape(value, (BLOCK_M, BLOCK_N // 2, 2)))
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        ptrs = out_ptr + rm[:, None] * stride_om + cols[None, :]
        ok = m_ok[:, None] & (cols < N // 2)[None, :]
        tl.store(ptrs, silu_mul_values(gate, up, out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptrs, value, mask=out_ok)


@triton.jit
def _gemv(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, k_split, stride_xm,
          stride_wn, stride_om, stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
          HAS_SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
          HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr, E4M3_BITS: tl.constexpr = False,
          DOT: tl.constexpr = False, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
          LINE: tl.constexpr = 128, GATED: tl.constexpr = False,
          PAIRED: tl.constexpr = False):  # fmt: skip
    # HAS_SCALE False: a plain (bf16 / fp16) weight, no scale (s_ptr unused). SCALE_BK == 0: one
    # scale per channel, s[N]; else one per (SCALE_BN, SCALE_BK) block, s[ceil(N / SCALE_BN),
    # ceil(K / SCALE_BK)] (row stride stride_sn), BLOCK_K dividing SCALE_BK. HAS_BIAS: + b[N]
    # in fp32 before the one rounding to the output dtype (as cuBLAS's bias epilogue). GATED: w is
    # [gate | up] (N = 2I rows); a program takes BLOCK_N / 2 channels of each, gate and up rows
    # interleaved in its tile, and stores silu(gate) * up [M, I] of its rounded sums
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PAIRED:  # GATED on the tensor cores, one split: gate and up rows in two accumulators
        pair = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        rm = tl.arange(0, BLOCK_M)
        pdl_enter(PDL)
        _paired_epilogue(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, pair, pair < N // 2, rm, rm < M,
                         M, N, K, k_split, stride_xm, stride_wn, stride_om, stride_sn, BLOCK_M,
                         BLOCK_N // 2, BLOCK_K, EVEN_K, HAS_SCALE, HAS_BIAS)  # fmt: skip
        return
    if GATED:
        pair = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2  # the output channel
        rn = pair + (tl.arange(0, BLOCK_N) % 2) * (N // 2)  # gate row, up row, gate row, ...
        n_ok = pair < N // 2
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N  # uniform along a row: the 16-byte loads stay vectorised
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    out_ok = m_ok[:, None] & n_ok[None, :]
    if PREFETCH > 0:  # PDL: the first PREFETCH 128-byte lines of each weight row into L2 first
        lines = pid_k * k_split + tl.arange(0, PREFETCH) * LINE
        rows = tl.minimum(rn, N - 1).to(tl.int64)
        pdl_prefetch_enter(w_ptr + rows[:, None] * stride_wn + lines[None, :], PDL)
    else:
        pdl_enter(PDL)
    if DOT:
        acc = _accumulate_dot(x_ptr, w_ptr, rn, n_ok, M, k_split, stride_xm, stride_wn, BLOCK_M,
                              BLOCK_N, BLOCK_K)  # fmt: skip
    else:
        acc = _accumulate(x_ptr, w_ptr, s_ptr, rn, rm, n_ok, m_ok, K, k_split, stride_xm,
                          stride_wn, stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, HAS_SCALE,
                          SCALE_BN, SCALE_BK, WIDEN and not E4M3_BITS, E4M3_BITS)  # fmt: skip
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
        _store(out_ptr, out_ptrs, acc * scale + bias, out_ok, pid_n, rm, m_ok, N, stride_om,
               BLOCK_M, BLOCK_N, GATED)  # fmt: skip
    else:
        ws = ws_ptr + rm[:, None] * N + rn[None, :]  # split s at ws + s * BLOCK_M * N
        tl.store(ws + pid_k * BLOCK_M * N, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partials stored before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last program of this column block
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # split order: the same sum whoever arrives last
                total += tl.load(ws + s * BLOCK_M * N, mask=out_ok, other=0.0, cache_modifier=".cg")
            _store(out_ptr, out_ptrs, total * scale + bias, out_ok, pid_n, rm, m_ok, N, stride_om,
                   BLOCK_M, BLOCK_N, GATED)  # fmt: skip
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
    SiLU-mul kernel); each program takes half its tile's channels from each half."""
    m, k = x.shape
    n = weight.shape[0]
    if gated and n % 2:
        raise ValueError(f"gemv: gated needs [gate | up] rows, an even count; weight has {n}")
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
    if gated:
        block_n = max(block_n, 2)  # a gate and an up row at least
    num_blocks = triton.cdiv(n // 2, block_n // 2) if gated else triton.cdiv(n, block_n)
    if k % (split * block_k) or split * block_m * n > WORKSPACE_FLOATS or num_blocks > MAX_COUNTERS:
        split = 1  # the split path needs whole slices per split and room for its partials
    ws = _workspace(x.device) if split > 1 else None
    if ws is None:
        split, ws = 1, (x, x)  # unused by the unsplit kernel
    out = torch.empty((m, n // 2 if gated else n), dtype=x.dtype, device=x.device)
    k_split = k // split if split > 1 else k
    dot = dot and dot_fits(block_n, block_k, k_split)
    # gated on the tensor cores: two accumulators of 16+ rows each (PAIRED), unless split or
    # TORCH_RUNNER_GEMV_PAIRED=0 (the interleaved tile, split in the epilogue)
    paired = gated and dot and split == 1 and block_n >= 32 and PAIRED_GATED
    stages = stages or (dot_stages(m, n, k, plain) if dot else None)
    extra = launch_args(x.device)
    if stages is not None:
        extra["num_stages"] = stages
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
                               DOT=dot, GATED=gated, PAIRED=paired, num_warps=warps,
                               **extra)  # fmt: skip
    return out
