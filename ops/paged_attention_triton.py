"""Triton paged decode attention (CUDA): the kernel behind `ops.paged_attention` on CUDA.

Split-K flash decoding: program (row b, KV head h, split s) takes the G = Hq / Hkv query heads
that share KV head h (one tl.dot over a [G, D] query tile, padded to 16 rows), walks split s of
the row's visible keys [max(0, L - W), L) through the block table, and writes a partial output
and log-sum-exp; a second kernel merges the splits and adds the sinks to the denominator. The
split count depends on the batch shape and the table width only, never on a tensor value, so
the launch is the same at every replay of a CUDA graph. Checked against the torch reference in
tests/test_paged_attention.py (GPU-marked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.paged_attention import check_paged_args, split_min_keys
from ops.pdl import launch_args
from ops.pdl_triton import pdl_enter

BLOCK_N = 64  # keys per inner tile
TARGET_PROGRAMS = 264  # ~2 waves of the H200's 132 SMs
MAX_SPLITS = 32
MIN_SPLIT_KEYS = split_min_keys()  # read once (ops/paged_attention.py)


@triton.jit
def _partial_kernel(Q, K, V, Tables, Lens, Acc, Lse, Sinks, Out,
                    stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, stride_lens,
                    stride_ab, stride_ah, stride_as, stride_lb, stride_lh, stride_ob, stride_oh,
                    sm_scale, window,
                    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    PAGE: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                    PRECISION: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(PDL)
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    kv_len = tl.load(Lens + b * stride_lens).to(tl.int32)
    lo = kv_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(kv_len - window, 0)
    per = tl.cdiv(tl.cdiv(kv_len - lo, SPLITS), BLOCK) * BLOCK
    start = lo + sp * per
    end = tl.minimum(start + per, kv_len)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = hk * G + g
    g_ok = g < G
    d_ok = d < D
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    scale = sm_scale * 1.4426950408889634  # exp2 domain
    for n0 in range(start, end, BLOCK):
        pos = n0 + tl.arange(0, BLOCK)
        ok = pos < end
        page = tl.load(Tables + b * stride_tb + pos // PAGE, mask=ok, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        offs = slot[:, None] * stride_ks + hk * stride_kh + d[None, :]
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(K + offs, mask=kv_ok, other=0.0)
        v = tl.load(V + offs, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G_PAD, BLOCK]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if SPLITS == 1:  # the whole row here: softmax over the keys and the sink, out in q's dtype
        if HAS_SINKS:  # (log2 domain, like m)
            sink = tl.load(Sinks + heads, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            top = tl.maximum(m, sink)
            top = tl.where(top == float("-inf"), 0.0, top)
            keep = tl.exp2(m - top)  # 0 for a row without keys
            acc = acc * keep[:, None]
            total = total * keep + tl.exp2(sink - top)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])  # fmt: skip
    else:
        has = total > 0
        safe = tl.where(has, total, 1.0)
        out = acc / safe[:, None]
        lse = tl.where(has, (m + tl.log2(safe)) * 0.6931471805599453, float("-inf"))
        tl.store(Acc + b * stride_ab + heads[:, None] * stride_ah + sp * stride_as + d[None, :],
                 out, mask=g_ok[:, None] & d_ok[None, :])  # fmt: skip
        tl.store(Lse + b * stride_lb + heads * stride_lh + sp, lse, mask=g_ok)


@triton.jit
def _merge_kernel(Acc, Lse, Sinks, Out,
                  stride_ab, stride_ah, stride_as, stride_lb, stride_lh, stride_ob, stride_oh,
                  D: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
                  SPLITS_PAD: tl.constexpr, HAS_SINKS: tl.constexpr,
                  PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < SPLITS
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # [SPLITS_PAD]; empty splits weigh 0
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp(sink - m)
    acc = tl.load(Acc + b * stride_ab + h * stride_ah + s[:, None] * stride_as + d[None, :],
                  mask=s_ok[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < D)


def num_splits(batch: int, num_kv_heads: int, max_keys: int) -> int:
    """Splits per (row, KV head): enough programs to fill the GPU, at most one per
    `split_min_keys()` keys (default one key tile: a short context at batch 1 still splits)."""
    want = triton.cdiv(TARGET_PROGRAMS, batch * num_kv_heads)
    return max(1, min(want, triton.cdiv(max_keys, max(BLOCK_N, MIN_SPLIT_KEYS)), MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    block_size: int,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Same contract as ops.paged_attention.paged_decode_attention (the reference)."""
    check_paged_args(q, k_pool, v_pool, block_tables, kv_lens, block_size, sinks)
    if q.stride(-1) != 1:
        q = q.contiguous()
    b, hq, d = q.shape
    hkv = k_pool.shape[1]
    group = hq // hkv
    max_keys = block_tables.shape[1] * block_size
    if window is not None:
        max_keys = min(max_keys, window)
    splits = num_splits(b, hkv, max_keys)
    acc = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    d_pad = triton.next_power_of_2(d)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _partial_kernel[(b, hkv, splits)](
        q, k_pool, v_pool, block_tables, kv_lens, acc, lse, sinks if sinks is not None else lse,
        out, q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), block_tables.stride(0),
        kv_lens.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), sm_scale, window or 0,
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, D_PAD=max(16, d_pad),
        PAGE=block_size, BLOCK=BLOCK_N, SPLITS=splits, HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None, PRECISION=precision, num_warps=4, **launch_args(q.device),
    )  # fmt: skip
    if splits == 1:  # the first kernel wrote the output
        return out
    _merge_kernel[(b, hq)](
        acc, lse, sinks if sinks is not None else lse, out,
        acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        D=d, D_PAD=max(16, d_pad), SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
        HAS_SINKS=sinks is not None, num_warps=1, **launch_args(q.device),
    )  # fmt: skip
    return out
