"""CUDA: the gpt-oss MoE computed from the packed MXFP4 bytes (Triton), with no host sync.

Two formulations, picked by the token count T (a Python int, so each shape gets one fixed grid
and a CUDA graph captures it):
- decode (T <= GEMV_MAX_TOKENS): no sorting at all. `_gemv_gate_up` runs one program per
  (token, slot) pair and BLOCK_N weight rows, reading the expert id from top_idx on the device,
  and adds the bias and applies the clamped SwiGLU in registers; `_gemv_down` does the same for
  the down projection (bias and router weight fused) and `_combine` sums each token's top_k
  rows in slot order. The dot products are fp32 FMAs: at one token a tensor-core tile would be
  15/16 padding. Three launches after the router.
- grouped (larger T): `_route_lists` (one program per expert) writes each expert's pair ids
  and count; `_grouped_gate_up` / `_grouped_down` run a program per (row block, column block,
  expert), return at once past the expert's count, and multiply with tl.dot, so each routed
  expert's weights are decoded once per row block; `_combine` as above.

Decoding: a byte holds the even element in its low nibble. An E2M1 code c becomes the fp16 bit
pattern (c & 7) << 9 | (c & 8) << 12, which is the E2M1 value times 2^-14 (the code's exponent
and mantissa bits land in fp16's, and E2M1's subnormal 0.5 is fp16's subnormal); the 2^14 goes
into the group scale, 2^(s - 127 + 14), built as fp32 bits (exact for scales up to 240, 2^113;
real checkpoints sit near 127). With WORDS (the default) the bytes are read as 32-bit words and
one shift-and-mask makes two such patterns at once (see _gemv_rows_words): the decode is
integer-issue bound at one token, so this is what sets the speed. Accumulation is fp32, the bias
added before one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.quant.mxfp4 import GROUP_SIZE, Mxfp4Experts

GEMV_MAX_TOKENS = 4  # at 8 tokens the grouped tiles won (277 vs 292 us a layer, H200)
# (BLOCK_N, BLOCK_G groups of 32 per step, num_warps, WORDS) per kernel; bench_mxfp4.py op --sweep
GEMV_CONFIG = {"gate_up": (32, 32, 4, True), "down": (16, 32, 4, True)}  # (.., WORDS decode)
# BLOCK_M -> (BN, BG, warps, stages, WORDS)
GROUPED_CONFIG = {16: (128, 2, 4, 4, True), 64: (128, 4, 8, 3, True)}


@triton.jit
def _e2m1(code):
    """E2M1 codes (int32, 0..15) -> fp32 values times 2^-14 (see the module docstring)."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale(exps):
    """Scale bytes (int32) -> fp32 2^(s - 127 + 14)."""
    return ((exps + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_rows_bytes(x_base, blocks_ptr, scales_ptr, expert, rows, is_row, N,
                     GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_G: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_G] fp32 partial dot products of W[expert][rows] with the vector at x_base,
    one byte (two codes) at a time; summed over the last axis by the caller."""
    g = tl.arange(0, BLOCK_G)
    b = tl.arange(0, 16)
    row_bytes = GROUPS * 16
    w_base = blocks_ptr + expert * N * row_bytes + rows.to(tl.int64)[:, None, None] * row_bytes
    s_base = scales_ptr + expert * N * GROUPS + rows.to(tl.int64)[:, None] * GROUPS
    acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
    for g0 in range(0, GROUPS, BLOCK_G):
        gi = g0 + g  # [G]
        is_g = gi < GROUPS
        w_mask = is_row[:, None, None] & is_g[None, :, None]
        packed = tl.load(w_base + gi[None, :, None] * 16 + b[None, None, :], mask=w_mask, other=0)
        packed = packed.to(tl.int32)  # [BN, G, 16]
        exps = tl.load(s_base + gi[None, :], mask=is_row[:, None] & is_g[None, :], other=0)
        col = gi[:, None] * 32 + 2 * b[None, :]  # [G, 16] even input columns
        x_even = tl.load(x_base + col, mask=is_g[:, None], other=0.0).to(tl.float32)
        x_odd = tl.load(x_base + col + 1, mask=is_g[:, None], other=0.0).to(tl.float32)
        prod = _e2m1(packed & 15) * x_even[None] + _e2m1(packed >> 4) * x_odd[None]
        acc += tl.sum(prod, axis=2) * _scale(exps.to(tl.int32))
    return acc


@triton.jit
def _f16_lanes(p):
    """int32 holding two fp16 bit patterns -> (low lane, high lane) as fp32."""
    lo = p.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _word_dot(part, lanes, xb, xm, first: tl.constexpr):
    """part += the two fp16 lanes times x at word offsets first and first + 4."""
    lo, hi = _f16_lanes(lanes)
    x_lo = tl.load(xb + first, mask=xm, other=0.0).to(tl.float32)
    x_hi = tl.load(xb + first + 4, mask=xm, other=0.0).to(tl.float32)
    return part + lo * x_lo[None] + hi * x_hi[None]


@triton.jit
def _gemv_rows_words(x_base, words_ptr, scales_ptr, expert, rows, is_row, N,
                     GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_G: tl.constexpr):  # fmt: skip
    """As _gemv_rows_bytes, four bytes (eight codes) per 32-bit word: each shift-and-mask makes
    two fp16 patterns at once (codes of bytes 0 and 2, or 1 and 3, are 16 bits apart), so the
    decode costs ~1.5 integer ops per value instead of ~5."""
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, 4)
    row_words = GROUPS * 4
    w_base = words_ptr + expert * N * row_words + rows.to(tl.int64)[:, None, None] * row_words
    s_base = scales_ptr + expert * N * GROUPS + rows.to(tl.int64)[:, None] * GROUPS
    acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
    for g0 in range(0, GROUPS, BLOCK_G):
        gi = g0 + g  # [G]
        is_g = gi < GROUPS
        w_mask = is_row[:, None, None] & is_g[None, :, None]
        w = tl.load(w_base + gi[None, :, None] * 4 + j[None, None, :], mask=w_mask, other=0)
        exps = tl.load(s_base + gi[None, :], mask=is_row[:, None] & is_g[None, :], other=0)
        xb = x_base + gi[:, None] * 32 + j[None, :] * 8  # [G, 4] first value of each word
        xm = is_g[:, None]
        part = tl.zeros([BLOCK_N, BLOCK_G, 4], dtype=tl.float32)
        # the sign mask 0x80008000 written as the int32 it is (-2147450880)
        part = _word_dot(part, ((w << 9) & 0x0E000E00) | ((w << 12) & -2147450880), xb, xm, 0)
        part = _word_dot(part, ((w << 5) & 0x0E000E00) | ((w << 8) & -2147450880), xb, xm, 1)
        part = _word_dot(part, ((w << 1) & 0x0E000E00) | ((w << 4) & -2147450880), xb, xm, 2)
        part = _word_dot(part, ((w >> 3) & 0x0E000E00) | (w & -2147450880), xb, xm, 3)
        acc += tl.sum(part, axis=2) * _scale(exps.to(tl.int32))
    return acc


@triton.jit
def _gemv_rows(x_base, blocks_ptr, words_ptr, scales_ptr, expert, rows, is_row, N,
               GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
               WORDS: tl.constexpr):  # fmt: skip
    """[BLOCK_N] fp32: W[expert][rows] . x for the vector at x_base (K = 32 * GROUPS values)."""
    if WORDS:
        acc = _gemv_rows_words(x_base, words_ptr, scales_ptr, expert, rows, is_row, N, GROUPS,
                               BLOCK_N, BLOCK_G)  # fmt: skip
    else:
        acc = _gemv_rows_bytes(x_base, blocks_ptr, scales_ptr, expert, rows, is_row, N, GROUPS,
                               BLOCK_N, BLOCK_G)  # fmt: skip
    return tl.sum(acc, axis=1)


@triton.jit
def _swiglu(acc, limit, alpha, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] interleaved gate/up -> [BLOCK_M, BLOCK_N // 2] clamped SwiGLU."""
    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1.0) * (gate * tl.sigmoid(gate * alpha))


@triton.jit
def _gemv_gate_up(x_ptr, top_idx_ptr, blocks_ptr, words_ptr, scales_ptr, bias_ptr, h_ptr, N,
                  GROUPS: tl.constexpr, stride_x, stride_h, limit, alpha, TOP_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                  WORDS: tl.constexpr):  # fmt: skip
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(top_idx_ptr + pair).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_row = rows < N
    x_base = x_ptr + (pair // TOP_K).to(tl.int64) * stride_x
    acc = _gemv_rows(x_base, blocks_ptr, words_ptr, scales_ptr, expert, rows, is_row, N, GROUPS,
                     BLOCK_N, BLOCK_G, WORDS)  # fmt: skip
    acc += tl.load(bias_ptr + expert * N + rows, mask=is_row, other=0.0).to(tl.float32)
    h = tl.reshape(_swiglu(tl.reshape(acc, [1, BLOCK_N]), limit, alpha, 1, BLOCK_N), [BLOCK_N // 2])
    cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + cols, h.to(h_ptr.dtype.element_ty),
             mask=cols < N // 2)  # fmt: skip


@triton.jit
def _gemv_down(h_ptr, top_idx_ptr, scores_ptr, blocks_ptr, words_ptr, scales_ptr, bias_ptr,
               y_ptr, N, GROUPS: tl.constexpr, stride_h, stride_y, BLOCK_N: tl.constexpr,
               BLOCK_G: tl.constexpr, WORDS: tl.constexpr):  # fmt: skip
    """One (token, slot) pair's router-weighted expert output, fp32 (combined by _combine)."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_row = rows < N
    expert = tl.load(top_idx_ptr + pair).to(tl.int64)
    h_base = h_ptr + pair.to(tl.int64) * stride_h
    y = _gemv_rows(h_base, blocks_ptr, words_ptr, scales_ptr, expert, rows, is_row, N, GROUPS,
                   BLOCK_N, BLOCK_G, WORDS)  # fmt: skip
    y += tl.load(bias_ptr + expert * N + rows, mask=is_row, other=0.0).to(tl.float32)
    y *= tl.load(scores_ptr + pair).to(tl.float32)
    tl.store(y_ptr + pair.to(tl.int64) * stride_y + rows, y, mask=is_row)


@triton.jit
def _combine(y_ptr, out_ptr, N, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t] = sum over the token's top_k slots of y[t * TOP_K + slot], in slot order."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + slot).to(tl.int64) * N + cols, mask=is_col)
    tl.store(out_ptr + token.to(tl.int64) * N + cols, acc.to(out_ptr.dtype.element_ty), mask=is_col)


@triton.jit
def _route_lists(top_idx_ptr, lists_ptr, counts_ptr, num_pairs, capacity,
                 BLOCK_P: tl.constexpr, NUM_CHUNKS: tl.constexpr):  # fmt: skip
    """Program e: the ids of the pairs routed to expert e, in pair order, and their count."""
    expert = tl.program_id(0)
    count = tl.zeros([], dtype=tl.int32)
    for chunk in range(NUM_CHUNKS):  # a constant trip count: one compile per power-of-2 bucket
        p = chunk * BLOCK_P + tl.arange(0, BLOCK_P)
        ids = tl.load(top_idx_ptr + p, mask=p < num_pairs, other=-1)
        hit = (ids == expert).to(tl.int32)
        pos = count + tl.cumsum(hit, 0) - hit  # exclusive prefix sum: slot in the expert's list
        tl.store(lists_ptr + expert * capacity + pos, p, mask=hit != 0)
        count += tl.sum(hit, 0)
    tl.store(counts_ptr + expert, count)


@triton.jit
def _grouped_tile(a_ptr, a_rows, is_m, stride_a, blocks_ptr, scales_ptr, expert, rows, is_row,
                  N, GROUPS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """[BLOCK_M, BLOCK_N] fp32: rows a_rows of A times W[expert][rows].T, on the tensor cores."""
    g = tl.arange(0, BLOCK_G)
    b = tl.arange(0, 16)
    j = tl.arange(0, BLOCK_G * 16)  # byte index inside the K step
    row_bytes = GROUPS * 16
    w_base = blocks_ptr + expert * N * row_bytes + rows.to(tl.int64)[:, None, None] * row_bytes
    s_base = scales_ptr + expert * N * GROUPS + rows.to(tl.int64)[:, None] * GROUPS
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_a
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, GROUPS, BLOCK_G):
        gi = g0 + g
        is_g = gi < GROUPS
        w_mask = is_row[:, None, None] & is_g[None, :, None]
        packed = tl.load(w_base + gi[None, :, None] * 16 + b[None, None, :], mask=w_mask, other=0)
        packed = packed.to(tl.int32)  # [BN, G, 16]
        exps = tl.load(s_base + gi[None, :], mask=is_row[:, None] & is_g[None, :], other=0)
        scale = _scale(exps.to(tl.int32))[:, :, None]
        col = g0 * 32 + 2 * j  # [G * 16] even input columns
        a_mask = is_m[:, None] & (col < GROUPS * 32)[None, :]
        a_even = tl.load(a_base + col[None, :], mask=a_mask, other=0.0)
        a_odd = tl.load(a_base + col[None, :] + 1, mask=a_mask, other=0.0)
        w_even = tl.reshape(_e2m1(packed & 15) * scale, [BLOCK_N, BLOCK_G * 16]).to(a_even.dtype)
        w_odd = tl.reshape(_e2m1(packed >> 4) * scale, [BLOCK_N, BLOCK_G * 16]).to(a_even.dtype)
        if IEEE:  # fp32 activations (tests, fp32 models): full-precision products
            acc += tl.dot(a_even, tl.trans(w_even), input_precision="ieee")
            acc += tl.dot(a_odd, tl.trans(w_odd), input_precision="ieee")
        else:
            acc += tl.dot(a_even, tl.trans(w_even))
            acc += tl.dot(a_odd, tl.trans(w_odd))
    return acc


@triton.jit
def _scaled_lanes(lanes, scale):
    """[BN, G, 4] int32 fp16 pairs -> [BN, G * 8] fp32 values (word, lane order) times scale."""
    lo, hi = _f16_lanes(lanes)
    both = tl.join(lo * scale, hi * scale)  # [BN, G, 4, 2]
    return tl.reshape(both, [both.shape[0], both.shape[1] * 8])


@triton.jit
def _grouped_tile_words(a_ptr, a_rows, is_m, stride_a, words_ptr, scales_ptr, expert, rows,
                        is_row, N, GROUPS: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_G: tl.constexpr):  # fmt: skip
    """As _grouped_tile, decoding 32-bit words (see _gemv_rows_words). The decoded K order is
    (word j, lane h, pair p) -> value 8j + 4h + p of the group; A is read in that order."""
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, 4)
    kk = tl.arange(0, BLOCK_G * 32)
    el = (
        (kk // 32) * 32 + ((kk // 8) % 4) * 8 + ((kk // 4) % 2) * 4 + ((kk // 2) % 2) + (kk % 2) * 2
    )
    row_words = GROUPS * 4
    w_base = words_ptr + expert * N * row_words + rows.to(tl.int64)[:, None, None] * row_words
    s_base = scales_ptr + expert * N * GROUPS + rows.to(tl.int64)[:, None] * GROUPS
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_a
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, GROUPS, BLOCK_G):
        gi = g0 + g
        is_g = gi < GROUPS
        w_mask = is_row[:, None, None] & is_g[None, :, None]
        w = tl.load(w_base + gi[None, :, None] * 4 + j[None, None, :], mask=w_mask, other=0)
        exps = tl.load(s_base + gi[None, :], mask=is_row[:, None] & is_g[None, :], other=0)
        scale = _scale(exps.to(tl.int32))[:, :, None]  # [BN, G, 1]
        p01 = tl.join(
            _scaled_lanes(((w << 9) & 0x0E000E00) | ((w << 12) & -2147450880), scale),
            _scaled_lanes(((w << 5) & 0x0E000E00) | ((w << 8) & -2147450880), scale),
        )
        p23 = tl.join(
            _scaled_lanes(((w << 1) & 0x0E000E00) | ((w << 4) & -2147450880), scale),
            _scaled_lanes(((w >> 3) & 0x0E000E00) | (w & -2147450880), scale),
        )
        col = g0 * 32 + el
        a_mask = is_m[:, None] & (col < GROUPS * 32)[None, :]
        a = tl.load(a_base + col[None, :], mask=a_mask, other=0.0)
        w_all = tl.reshape(tl.join(p01, p23), [BLOCK_N, BLOCK_G * 32]).to(a.dtype)
        if IEEE:
            acc += tl.dot(a, tl.trans(w_all), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w_all))
    return acc


@triton.jit
def _grouped_rows(a_ptr, a_rows, is_m, stride_a, blocks_ptr, words_ptr, scales_ptr, expert, rows,
                  is_row, N, GROUPS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                  WORDS: tl.constexpr):  # fmt: skip
    if WORDS:
        acc = _grouped_tile_words(a_ptr, a_rows, is_m, stride_a, words_ptr, scales_ptr, expert,
                                  rows, is_row, N, GROUPS, IEEE, BLOCK_M, BLOCK_N, BLOCK_G)  # fmt: skip
    else:
        acc = _grouped_tile(a_ptr, a_rows, is_m, stride_a, blocks_ptr, scales_ptr, expert, rows,
                            is_row, N, GROUPS, IEEE, BLOCK_M, BLOCK_N, BLOCK_G)  # fmt: skip
    return acc


@triton.jit
def _grouped_gate_up(x_ptr, lists_ptr, counts_ptr, blocks_ptr, words_ptr, scales_ptr, bias_ptr,
                     h_ptr, N, GROUPS: tl.constexpr, capacity, stride_x, stride_h, limit, alpha,
                     TOP_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                     WORDS: tl.constexpr):  # fmt: skip
    pid_m, pid_n, expert = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(counts_ptr + expert)
    if pid_m * BLOCK_M >= count:
        return
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    is_m = m < count
    pairs = tl.load(lists_ptr + expert * capacity + m, mask=is_m, other=0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_row = rows < N
    e64 = expert.to(tl.int64)
    acc = _grouped_rows(x_ptr, pairs // TOP_K, is_m, stride_x, blocks_ptr, words_ptr, scales_ptr,
                        e64, rows, is_row, N, GROUPS, IEEE, BLOCK_M, BLOCK_N, BLOCK_G,
                        WORDS)  # fmt: skip
    acc += tl.load(bias_ptr + e64 * N + rows, mask=is_row, other=0.0).to(tl.float32)[None, :]
    h = _swiglu(acc, limit, alpha, BLOCK_M, BLOCK_N)
    cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    ptrs = h_ptr + pairs.to(tl.int64)[:, None] * stride_h + cols[None, :]
    tl.store(ptrs, h.to(h_ptr.dtype.element_ty), mask=is_m[:, None] & (cols < N // 2)[None, :])


@triton.jit
def _grouped_down(h_ptr, lists_ptr, counts_ptr, scores_ptr, blocks_ptr, words_ptr, scales_ptr,
                  bias_ptr, y_ptr, N, GROUPS: tl.constexpr, capacity, stride_h, stride_y,
                  IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_G: tl.constexpr, WORDS: tl.constexpr):  # fmt: skip
    pid_m, pid_n, expert = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(counts_ptr + expert)
    if pid_m * BLOCK_M >= count:
        return
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    is_m = m < count
    pairs = tl.load(lists_ptr + expert * capacity + m, mask=is_m, other=0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_row = rows < N
    e64 = expert.to(tl.int64)
    acc = _grouped_rows(h_ptr, pairs, is_m, stride_h, blocks_ptr, words_ptr, scales_ptr, e64, rows,
                        is_row, N, GROUPS, IEEE, BLOCK_M, BLOCK_N, BLOCK_G, WORDS)  # fmt: skip
    acc += tl.load(bias_ptr + e64 * N + rows, mask=is_row, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(scores_ptr + pairs, mask=is_m, other=0.0).to(tl.float32)[:, None]
    ptrs = y_ptr + pairs.to(tl.int64)[:, None] * stride_y + rows[None, :]
    tl.store(ptrs, acc, mask=is_m[:, None] & is_row[None, :])


def _check(gate_up: Mxfp4Experts, down: Mxfp4Experts) -> None:
    if gate_up.in_features % GROUP_SIZE or down.in_features % GROUP_SIZE:
        raise ValueError("moe_gpt_oss: MXFP4 in-features must be multiples of 32")
    for p in (gate_up, down):
        if not (p.blocks.is_contiguous() and p.scales.is_contiguous()):
            raise ValueError("moe_gpt_oss: MXFP4 blocks and scales must be contiguous")


def _geometry(p: Mxfp4Experts) -> tuple[int, int]:
    """(rows N, scale groups per row: a kernel constant) of one expert matrix."""
    return p.out_features, p.in_features // GROUP_SIZE


def _combined(y: torch.Tensor, num_tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T * k, H] fp32 router-weighted pair outputs -> [T, H] in dtype (one launch)."""
    n = y.shape[1]
    out = torch.empty(num_tokens, n, dtype=dtype, device=y.device)
    _combine[(num_tokens, triton.cdiv(n, 1024))](y, out, n, TOP_K=top_k, BLOCK_N=1024)
    return out


def _moe_gemv(x, top_idx, scores, gate_up, gate_up_bias, down, down_bias, limit, alpha, config):
    num_tokens, top_k = top_idx.shape
    num_pairs = num_tokens * top_k
    (bn_gu, bg_gu, w_gu, words_gu), (bn_dn, bg_dn, w_dn, words_dn) = config or (
        GEMV_CONFIG["gate_up"], GEMV_CONFIG["down"])  # fmt: skip
    n, groups = _geometry(gate_up)
    h = torch.empty(num_pairs, n // 2, dtype=x.dtype, device=x.device)  # [P, I]
    _gemv_gate_up[(num_pairs, triton.cdiv(n, bn_gu))](
        x, top_idx, gate_up.blocks, gate_up.blocks.view(torch.int32), gate_up.scales, gate_up_bias,
        h, n, groups, x.stride(0), h.stride(0), limit, alpha, TOP_K=top_k, BLOCK_N=bn_gu,
        BLOCK_G=bg_gu, WORDS=words_gu, num_warps=w_gu,
    )  # fmt: skip
    n, groups = _geometry(down)
    y = torch.empty(num_pairs, n, dtype=torch.float32, device=x.device)  # [P, H]
    _gemv_down[(num_pairs, triton.cdiv(n, bn_dn))](
        h, top_idx, scores, down.blocks, down.blocks.view(torch.int32), down.scales, down_bias, y,
        n, groups, h.stride(0), y.stride(0), BLOCK_N=bn_dn, BLOCK_G=bg_dn, WORDS=words_dn,
        num_warps=w_dn,
    )  # fmt: skip
    return _combined(y, num_tokens, top_k, x.dtype)


def _moe_grouped(x, top_idx, scores, gate_up, gate_up_bias, down, down_bias, limit, alpha,
                 capacity, config):  # fmt: skip
    num_tokens, top_k = top_idx.shape
    num_pairs, num_experts = num_tokens * top_k, gate_up.num_experts
    block_m = 16 if num_tokens <= 128 else 64
    block_n, block_g, num_warps, num_stages, words = config or GROUPED_CONFIG[block_m]
    lists = torch.empty(num_experts, capacity, dtype=torch.int32, device=x.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=x.device)
    block_p = min(1024, triton.next_power_of_2(num_pairs))
    _route_lists[(num_experts,)](top_idx, lists, counts, num_pairs, capacity, BLOCK_P=block_p,
                                 NUM_CHUNKS=triton.cdiv(num_pairs, block_p))  # fmt: skip
    ieee = x.dtype == torch.float32
    n, groups = _geometry(gate_up)
    h = torch.empty(num_pairs, n // 2, dtype=x.dtype, device=x.device)  # [P, I]
    grid = (triton.cdiv(capacity, block_m), triton.cdiv(n, block_n), num_experts)
    _grouped_gate_up[grid](
        x, lists, counts, gate_up.blocks, gate_up.blocks.view(torch.int32), gate_up.scales,
        gate_up_bias, h, n, groups,
        capacity, x.stride(0), h.stride(0), limit, alpha, TOP_K=top_k, IEEE=ieee, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_G=block_g, WORDS=words, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    n, groups = _geometry(down)
    y = torch.empty(num_pairs, n, dtype=torch.float32, device=x.device)  # [P, H] router-weighted
    grid = (triton.cdiv(capacity, block_m), triton.cdiv(n, block_n), num_experts)
    _grouped_down[grid](
        h, lists, counts, scores, down.blocks, down.blocks.view(torch.int32), down.scales,
        down_bias, y, n, groups,
        capacity, h.stride(0), y.stride(0), IEEE=ieee, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_G=block_g, WORDS=words, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return _combined(y, num_tokens, top_k, x.dtype)


def moe_experts_mxfp4(
    x: torch.Tensor,
    top_idx: torch.Tensor,
    scores: torch.Tensor,
    gate_up: Mxfp4Experts,
    gate_up_bias: torch.Tensor,
    down: Mxfp4Experts,
    down_bias: torch.Tensor,
    limit: float,
    alpha: float,
    *,
    is_expert_parallel: bool = False,
    formulation: str | None = None,
    config=None,
) -> torch.Tensor:
    """x [T, H], top_idx / scores [T, k] (router weights) -> the MoE output [T, H] in x's dtype.

    formulation: "gemv" or "grouped" (default: by T, see the module docstring); config overrides
    the block sizes (tools/bench_mxfp4.py op --sweep). Under expert parallel several slots of one
    token can point at the local expert 0 (ops.routing.local_experts), so each expert's list
    holds up to T * k pairs instead of T.
    """
    _check(gate_up, down)
    num_tokens, top_k = top_idx.shape
    x, top_idx, scores = x.contiguous(), top_idx.contiguous(), scores.contiguous()
    formulation = formulation or ("gemv" if num_tokens <= GEMV_MAX_TOKENS else "grouped")
    if formulation == "gemv":
        return _moe_gemv(x, top_idx, scores, gate_up, gate_up_bias, down, down_bias, limit,
                         alpha, config)  # fmt: skip
    if formulation != "grouped":
        raise ValueError(
            f"moe_experts_mxfp4: formulation must be 'gemv' or 'grouped'; got {formulation!r}"
        )
    capacity = num_tokens * top_k if is_expert_parallel else num_tokens
    return _moe_grouped(x, top_idx, scores, gate_up, gate_up_bias, down, down_bias, limit, alpha,
                        capacity, config)  # fmt: skip
