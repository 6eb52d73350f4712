"""One Triton kernel for a decode layer's attention on CUDA: rope, the paged KV write, split-K
flash decoding and the merge of the splits.

Why: the graph decode ran three kernels per layer for this (ops/fused `_rope_kv_kernel`, then
`_partial_kernel` and `_merge_kernel` of ops/paged_attention_triton.py), and at batch 1 each
kernel boundary costs ~2 us on an H100/H200 (launch, ramp, tail): ~6 us a layer, 16-32 layers
a step. Here program (row b, KV head hk, split sp) of one grid does it all:

- it rotates its G = Hq / Hkv query heads itself from the unrotated qkv, with the arithmetic of
  `_rope_kv_kernel` (`rope_values`, no FMA: enable_fp_fusion=False), so q is the same bits;
- the split holding the row's newest key (position L - 1) rotates k of head hk, writes k and v
  to the pool at the row's write slot (the values `_rope_kv_kernel` writes), then syncs its
  threads (`tl.debug_barrier`) before its key loop reads the pool; only that split reads that
  slot. A padding row (L = 0) writes from split 0, to its scratch slot as before;
- the splits run `attend_keys` as `_partial_kernel` does; with one split the program writes the
  output. Otherwise each stores its partial (acc, lse) to a per-call buffer, syncs, and bumps
  the (b, hk) counter (acq_rel, gpu scope); the program that arrives last merges the splits of
  its G heads with `merge_partials` (the partials read with .cg, past L1), writes the output and
  resets the counter to 0 (the split-K pattern of ops/quant/gemv_triton.py).

The counters are allocated (zeroed) once per device outside graph capture and reset by the
kernel, so a CUDA graph replays it; calls on one device must be stream-ordered (the engine's
steps are), never concurrent. A split call captured before any eager call made the counters
runs the three kernels instead. The grid depends on (B, Hkv, table width, window) only.
Values: the pool and q bit for bit; the output equals the three kernels' up to fp32 rounding
(the attention math here is not FMA-contracted, and the merge reduces in another layout).
Checked in tests/test_fused_attend.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.fused.triton_kernels import _round, rope_kv_write
from ops.paged_attention import check_paged_args
from ops.paged_attention_triton import (
    BLOCK_N,
    TARGET_PROGRAMS,
    attend_keys,
    finish_row,
    merge_partials,
    num_splits,
    paged_decode_attention,
    split_bounds,
    split_partial,
)
from ops.pdl import launch_args
from ops.pdl_triton import pdl_enter

# one counter per (row, KV head) of a split call: num_splits gives one split (no counter) once
# B * Hkv reaches TARGET_PROGRAMS
MAX_COUNTERS = TARGET_PROGRAMS
_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def rope_values(x, swapped, cos, sin, rot, DTYPE: tl.constexpr):
    """x rotated where `rot` (HF rotate_half; `swapped` holds the partner dims), rounded to
    DTYPE at each step as torch's `rotate` is: `_rope_kv_kernel`'s arithmetic, in fp32."""
    turned = _round(_round(x * cos, DTYPE) + _round(swapped * sin, DTYPE), DTYPE)
    return tl.where(rot, turned, x)


@triton.jit
def _write_kv(Row, Cos, Sin, Slots, K, V, b, hk, stride_h, stride_cb, stride_sb, stride_slot,
              stride_ks, stride_kh, stride_vs, stride_vh, d, d_ok, rot, partner,
              HQ: tl.constexpr, HKV: tl.constexpr):  # fmt: skip
    """Rotate k of head hk of row b (qkv row at `Row`), store k and v at the row's write slot."""
    k_row = Row + (HQ + hk) * stride_h
    x = tl.load(k_row + d, mask=d_ok, other=0.0).to(tl.float32)
    swapped = tl.load(k_row + partner, mask=rot, other=0.0).to(tl.float32)
    cos = tl.load(Cos + b * stride_cb + d, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(Sin + b * stride_sb + d, mask=rot, other=0.0).to(tl.float32)
    k = rope_values(x, swapped, cos, sin, rot, Row.dtype.element_ty)
    v = tl.load(Row + (HQ + HKV + hk) * stride_h + d, mask=d_ok, other=0.0).to(tl.float32)
    slot = tl.load(Slots + b * stride_slot).to(tl.int64)  # a column of the graph's inputs
    tl.store(K + slot * stride_ks + hk * stride_kh + d, k.to(K.dtype.element_ty), mask=d_ok)
    tl.store(V + slot * stride_vs + hk * stride_vh + d, v.to(V.dtype.element_ty), mask=d_ok)


@triton.jit
def _rope_attend_kernel(QKV, Cos, Sin, Slots, K, V, Tables, Lens, Acc, Lse, Counts, Sinks, Out, Q,
                        stride_b, stride_h, stride_cb, stride_sb, stride_slot, stride_ks,
                        stride_kh, stride_vs, stride_vh, stride_tb, stride_lens, stride_ab,
                        stride_ah, stride_as, stride_lb, stride_lh, stride_ob, stride_oh,
                        sm_scale, window,
                        HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                        G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        ROT: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                        SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                        PRECISION: tl.constexpr, STORE_Q: tl.constexpr,
                        PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(PDL)
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    kv_len = tl.load(Lens + b * stride_lens).to(tl.int32)
    start, end, per = split_bounds(kv_len, window, sp, SPLITS, BLOCK, HAS_WINDOW)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = hk * G + g
    g_ok = g < G
    d_ok = d < D
    rot = d < ROT  # rotate the first ROT dims (HF rotate_half layout)
    partner = tl.where(d < ROT // 2, d + ROT // 2, d - ROT // 2)
    dtype = QKV.dtype.element_ty
    row = QKV + b.to(tl.int64) * stride_b
    # the G query heads, rotated here: the q `_rope_kv_kernel` would write
    x = tl.load(row + heads[:, None] * stride_h + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
    swapped = tl.load(row + heads[:, None] * stride_h + partner[None, :],
                      mask=g_ok[:, None] & rot[None, :], other=0.0).to(tl.float32)  # fmt: skip
    cos = tl.load(Cos + b * stride_cb + d, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(Sin + b * stride_sb + d, mask=rot, other=0.0).to(tl.float32)
    q = rope_values(x, swapped, cos[None, :], sin[None, :], rot[None, :], dtype).to(dtype)
    if STORE_Q:  # the tests' view of q, [B, Hq, D] contiguous, from split 0
        q_at = Q + (b * HQ + heads[:, None]) * D + d[None, :]
        tl.store(q_at, q, mask=g_ok[:, None] & d_ok[None, :] & (sp == 0))
    newest = kv_len - 1
    is_writer = (start <= newest) & (newest < start + per)  # one split when kv_len > 0
    if is_writer | ((kv_len == 0) & (sp == 0)):  # padding rows: their scratch slot, as before
        _write_kv(row, Cos, Sin, Slots, K, V, b, hk, stride_h, stride_cb, stride_sb,
                  stride_slot, stride_ks, stride_kh, stride_vs, stride_vh, d, d_ok, rot,
                  partner, HQ, HKV)  # fmt: skip
        tl.debug_barrier()  # every thread's k / v stored before the key loop reads the slot
    m, total, acc = attend_keys(q, K, V, Tables, b, hk, start, end, stride_ks, stride_kh,
                                stride_tb, sm_scale, d, d_ok, G_PAD, D_PAD, PAGE, BLOCK,
                                PRECISION)  # fmt: skip
    out_mask = g_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:  # the whole row here: no partials, no counter
        out = finish_row(m, total, acc, Sinks, heads, g_ok, HAS_SINKS)
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=out_mask)  # fmt: skip
    else:
        part, lse = split_partial(m, total, acc)
        tl.store(Acc + b * stride_ab + heads[:, None] * stride_ah + sp * stride_as + d[None, :],
                 part, mask=out_mask)  # fmt: skip
        tl.store(Lse + b * stride_lb + heads * stride_lh + sp, lse, mask=g_ok)
        tl.debug_barrier()  # every thread's partials stored before the release below
        count = Counts + b * HKV + hk
        arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:  # the last split of (b, hk) to finish merges its heads
            s = tl.arange(0, SPLITS_PAD)
            s_ok = s < SPLITS
            for i in range(G):
                h = hk * G + i
                lse_h = tl.load(Lse + b * stride_lb + h * stride_lh + s, mask=s_ok,
                                other=float("-inf"), cache_modifier=".cg")  # fmt: skip
                acc_h = tl.load(Acc + b * stride_ab + h * stride_ah + s[:, None] * stride_as
                                + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0,
                                cache_modifier=".cg")  # fmt: skip
                out_h = merge_partials(lse_h, acc_h, Sinks, h, HAS_SINKS)
                tl.store(Out + b * stride_ob + h * stride_oh + d, out_h.to(Out.dtype.element_ty),
                         mask=d_ok)  # fmt: skip
            tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")  # for the next call


def _counter_buffer(device: torch.device) -> torch.Tensor | None:
    """The device's (row, KV head) arrival counters (zeroed once; the kernel resets them), or
    None inside a graph capture before any eager call made them (capture memory is the
    graph's)."""
    found = _counters.get(device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if found is None and not capturing:
        found = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
        _counters[device] = found
    return found


def fused_rope_attend(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    num_q_heads: int,
    block_size: int,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """rope_kv_write (ops.rope) then paged_decode_attention (ops.paged_attention) in one
    launch: unrotated qkv [B, Hq + 2 Hkv, D], rope rows cos / signed_sin [B, D_rot], pools
    [slots, Hkv, D] written at `slots` [B], tables [B, blocks], kv_lens [B] -> [B, Hq, D].
    q_out: a contiguous [B, Hq, D] tensor in qkv's dtype that also gets the rotated q (tests)."""
    b, heads, d = qkv.shape
    hq = num_q_heads
    hkv = (heads - hq) // 2
    if heads != hq + 2 * hkv or k_pool.shape[1:] != (hkv, d):
        raise ValueError(
            f"fused_rope_attend: qkv [B, Hq + 2 Hkv, D] = {tuple(qkv.shape)} with Hq={hq} "
            f"does not match the pool's [slots, Hkv, D] = {tuple(k_pool.shape)}"
        )
    check_paged_args(qkv[:, :hq], k_pool, v_pool, tables, kv_lens, block_size, sinks)
    max_keys = tables.shape[1] * block_size
    if window is not None:
        max_keys = min(max_keys, window)
    splits = num_splits(b, hkv, max_keys)
    counts = _counter_buffer(qkv.device) if splits > 1 else kv_lens  # unused with one split
    if counts is None:  # captured before the counters exist: the three kernels
        q = rope_kv_write(qkv, cos, signed_sin, k_pool, v_pool, slots, hq)
        if q_out is not None:
            q_out.copy_(q)
        return paged_decode_attention(q, k_pool, v_pool, tables, kv_lens, block_size=block_size,
                                      sm_scale=sm_scale, sinks=sinks, window=window)  # fmt: skip
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    acc = torch.empty((b, hq, splits if splits > 1 else 0, d), dtype=torch.float32,
                      device=qkv.device)  # fmt: skip
    lse = torch.empty(acc.shape[:3], dtype=torch.float32, device=qkv.device)
    out = torch.empty((b, hq, d), dtype=qkv.dtype, device=qkv.device)
    group = hq // hkv
    d_pad = max(16, triton.next_power_of_2(d))
    _rope_attend_kernel[(b, hkv, splits)](
        qkv, cos, signed_sin, slots, k_pool, v_pool, tables, kv_lens, acc, lse, counts,
        sinks if sinks is not None else lse, out, out if q_out is None else q_out,
        qkv.stride(0), qkv.stride(1), cos.stride(0), signed_sin.stride(0), slots.stride(0),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), tables.stride(0),
        kv_lens.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), sm_scale, window or 0,
        HQ=hq, HKV=hkv, G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, D_PAD=d_pad,
        ROT=cos.shape[-1], PAGE=block_size, BLOCK=BLOCK_N, SPLITS=splits,
        SPLITS_PAD=triton.next_power_of_2(splits), HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None, PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
        STORE_Q=q_out is not None,
        num_warps=4, enable_fp_fusion=False,  # no FMA: torch rounds x*cos before the add
        **launch_args(qkv.device),
    )  # fmt: skip
    return out
