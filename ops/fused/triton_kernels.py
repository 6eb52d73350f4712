"""Triton kernels for the CUDA decode step; the torch ops they replace are their references.

Why: a 1B batch-1 decode step launched ~26 kernels per layer, half of them elementwise glue
(fp32 casts of the norm input and weight, the residual add, rope's flip/mul/mul/add, two
index_copy_ into the pool, silu then mul). Each kernel here does one of those groups in a
single pass, reads weights in their stored dtype (no per-call cast) and accumulates in fp32.

Rounding follows the torch reference so results match it: where torch rounds an intermediate
to the tensor dtype (bf16 rope: x*cos, swapped*sin, their sum; SwiGLU's chain of ops), the
kernel rounds there too (`_round`), so rope and the activations are bit-identical to torch;
rms_norm rounds once at the end like the torch path (fp32 math), differing only in the
reduction order of the mean of squares. Checked in tests/test_ops_fused.py (GPU-marked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.pdl import launch_args
from ops.pdl_triton import pdl_enter


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 -> the storage dtype -> fp32: where a torch op on DTYPE tensors would round."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(X, R, W, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, H, eps,
                         BLOCK: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    dtype = Out.dtype.element_ty
    s = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:  # the bf16 residual add of torch: fp32 sum rounded to the dtype
        r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        s = _round(s + r, dtype)
        tl.store(ResOut + row * stride_ro + cols, s.to(dtype), mask=ok)
    scale = tl.rsqrt(tl.sum(s * s, 0) / H + eps)
    y = s * scale
    if HAS_W:
        y = y * tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, y.to(dtype), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight, eps: float):
    """(rms_norm(s), s) with s = x + residual (s = x when residual is None); x [..., H]."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    r2 = x2 if residual is None else residual.reshape(-1, h)
    if x2.stride(-1) != 1 or r2.stride(-1) != 1:
        x2, r2 = x2.contiguous(), r2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = x2 if residual is None else torch.empty_like(out)
    block = triton.next_power_of_2(h)
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, x2 if weight is None else weight, out, res_out,
        x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), h, eps,
        BLOCK=block, HAS_RES=residual is not None, HAS_W=weight is not None, num_warps=warps,
        **launch_args(x.device),
    )  # fmt: skip
    return out.view(x.shape), x if residual is None else res_out.view(x.shape)


@triton.jit
def silu_mul_values(g, u, DTYPE: tl.constexpr):
    """silu(g) * u rounded as torch rounds `F.silu(g) * u` on DTYPE tensors (silu to DTYPE, then
    the product), from g and u in any float type: the SiLU-mul kernel's math, and the one-row
    GEMV's when it reads gate_up itself (ops/quant/gemv_triton.py)."""
    g = g.to(tl.float32)
    act = _round(g / (1.0 + tl.exp(-g)), DTYPE)  # F.silu rounds to the dtype, then `* up`
    return (act * u.to(tl.float32)).to(DTYPE)


@triton.jit
def _silu_mul_kernel(
    X, Out, stride_x, stride_o, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    dtype = Out.dtype.element_ty
    g = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    u = tl.load(X + row * stride_x + inter + cols, mask=ok, other=0.0)
    tl.store(Out + row * stride_o + cols, silu_mul_values(g, u, dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] = [gate | up] -> [..., I]."""
    two_i = gate_up.shape[-1]
    x2 = gate_up.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    inter = two_i // 2
    out = torch.empty((x2.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2,
        out,
        x2.stride(0),
        out.stride(0),
        inter,
        BLOCK=block,
        num_warps=4,
        **launch_args(x2.device),
    )
    return out.view(*gate_up.shape[:-1], inter)


@triton.jit
def _swiglu_kernel(X, Bias, Rows, Out, stride_x, stride_b, stride_rows, stride_o, inter, limit,
                   alpha,
                   BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    dtype = Out.dtype.element_ty
    g = tl.load(X + row * stride_x + 2 * cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + 2 * cols + 1, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:  # h + bias[rows] of the reference, rounded like the bf16 add
        b_row = tl.load(Rows + row * stride_rows).to(tl.int64)
        g = _round(g + tl.load(Bias + b_row * stride_b + 2 * cols, mask=ok).to(tl.float32), dtype)
        u = _round(u + tl.load(Bias + b_row * stride_b + 2 * cols + 1, mask=ok).to(tl.float32),
                   dtype)  # fmt: skip
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    sig = _round(1.0 / (1.0 + tl.exp(-_round(g * alpha, dtype))), dtype)
    glu = _round(g * sig, dtype)
    out = _round(u + 1.0, dtype) * glu
    tl.store(Out + row * stride_o + cols, out.to(dtype), mask=ok)


def clamped_swiglu(h, limit: float, alpha: float, bias=None, bias_rows=None) -> torch.Tensor:
    """gpt-oss's activation of h [T, 2I] (gate/up interleaved) -> [T, I]; with `bias` [E, 2I]
    and `bias_rows` [T], h + bias[bias_rows] first."""
    if h.stride(-1) != 1:
        h = h.contiguous()
    t, two_i = h.shape
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=h.dtype, device=h.device)
    block = min(1024, triton.next_power_of_2(inter))
    has_bias = bias is not None
    _swiglu_kernel[(t, triton.cdiv(inter, block))](
        h, bias if has_bias else h, bias_rows if has_bias else h, out, h.stride(0),
        bias.stride(0) if has_bias else 0, bias_rows.stride(0) if has_bias else 0,
        out.stride(0), inter, float(limit), float(alpha),
        BLOCK=block, HAS_BIAS=has_bias, num_warps=4, **launch_args(h.device),
    )  # fmt: skip
    return out


@triton.jit
def rope_pair_values(lo, hi, c_lo, s_lo, c_hi, s_hi, DTYPE: tl.constexpr):
    """Rotate-half rope of the column pairs (d, d + D_rot / 2) of DTYPE values lo, hi by their
    cos / signed-sin entries, rounded where `_rope_kv_kernel` (torch's bf16 rope) rounds ->
    fp32 (the one-row GEMV's q/k/v epilogue, ops/quant/gemv_epilogue.py). Compile the caller with
    enable_fp_fusion=False, as the rope kernel is: on sm_90 Triton's FMA contraction reached the
    products through the DTYPE rounding between them (1 ulp off torch's rope, H200 2026-12-07)."""
    lo, hi = lo.to(tl.float32), hi.to(tl.float32)
    c_lo, s_lo = c_lo.to(tl.float32), s_lo.to(tl.float32)
    c_hi, s_hi = c_hi.to(tl.float32), s_hi.to(tl.float32)
    new_lo = _round(_round(lo * c_lo, DTYPE) + _round(hi * s_lo, DTYPE), DTYPE)
    new_hi = _round(_round(hi * c_hi, DTYPE) + _round(lo * s_hi, DTYPE), DTYPE)
    return new_lo, new_hi


@triton.jit
def _rope_kv_kernel(QKV, Cos, Sin, Slots, Q, K, V,
                    stride_t, stride_h, stride_ct, stride_st, stride_slot, stride_qt, stride_qh,
                    stride_ks, stride_kh, stride_vs, stride_vh,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    ROT: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    ok = d < D
    dtype = Q.dtype.element_ty
    base = QKV + t * stride_t + head * stride_h
    x = tl.load(base + d, mask=ok, other=0.0).to(tl.float32)
    slot = tl.load(Slots + t * stride_slot).to(tl.int64)  # a column of the graph's inputs
    if head < HQ + HKV:  # q or k: rotate the first ROT dims (HF rotate_half layout)
        rot = d < ROT
        half = ROT // 2
        partner = tl.where(d < half, d + half, d - half)
        swapped = tl.load(base + partner, mask=rot, other=0.0).to(tl.float32)
        cos = tl.load(Cos + t * stride_ct + d, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(Sin + t * stride_st + d, mask=rot, other=0.0).to(tl.float32)
        turned = _round(_round(x * cos, dtype) + _round(swapped * sin, dtype), dtype)
        x = tl.where(rot, turned, x)
        if head < HQ:
            tl.store(Q + t * stride_qt + head * stride_qh + d, x.to(dtype), mask=ok)
        else:
            k_out = K + slot * stride_ks + (head - HQ) * stride_kh + d
            tl.store(k_out, x.to(K.dtype.element_ty), mask=ok)
    else:
        v_out = V + slot * stride_vs + (head - HQ - HKV) * stride_vh + d
        tl.store(v_out, x.to(V.dtype.element_ty), mask=ok)


def rope_kv_write(qkv, cos, signed_sin, k_pool, v_pool, slots, num_q_heads: int):
    """Rotate q and k of qkv [T, Hq + 2 Hkv, D] by the rope tables cos / signed_sin [T, D_rot],
    write k and v to k_pool / v_pool [slots, Hkv, D] at `slots` [T]; return q [T, Hq, D]."""
    t, heads, d = qkv.shape
    hkv = (heads - num_q_heads) // 2
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty((t, num_q_heads, d), dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(t, heads)](
        qkv, cos, signed_sin, slots, q, k_pool, v_pool,
        qkv.stride(0), qkv.stride(1), cos.stride(0), signed_sin.stride(0), slots.stride(0),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        HQ=num_q_heads, HKV=hkv, D=d, D_PAD=triton.next_power_of_2(d), ROT=cos.shape[-1],
        num_warps=1, enable_fp_fusion=False,  # no FMA: torch rounds x*cos before the add
        **launch_args(qkv.device),
    )  # fmt: skip
    return q


@triton.jit
def _resolve_kernel(Ids, Future, stride_ids, rows, futures, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(PDL)
    i = tl.arange(0, BLOCK)
    ok = i < rows
    ids = tl.load(Ids + i * stride_ids, mask=ok, other=0)
    row = -ids - 1  # a placeholder -(r + 1) stands for Future[r]
    held = ok & (ids < 0) & (row < futures)
    picked = tl.load(Future + row, mask=held, other=0).to(ids.dtype)
    tl.store(Ids + i * stride_ids, picked, mask=held)


def resolve_placeholders_(ids: torch.Tensor, future: torch.Tensor) -> None:
    """In place: every placeholder -(r + 1) of the int ids [B] (any stride) becomes future[r]
    (torch_runner/runner/launched.py); one program, no host sync."""
    rows, future = ids.shape[0], future.reshape(-1)
    _resolve_kernel[(1,)](
        ids, future, ids.stride(0), rows, future.numel(),
        BLOCK=max(16, triton.next_power_of_2(rows)), num_warps=1, **launch_args(ids.device),
    )  # fmt: skip


GREEDY_CHUNK = 4096  # logits per program of the greedy pick's first pass
_FLOAT_MAX = tl.constexpr(3.4028234663852886e38)  # torch.finfo(torch.float32).max (a constexpr:
# kernels read only constexpr globals)


@triton.jit
def _greedy_chunk_kernel(L, Best, Index, Bad, stride_l, V, CHUNK: tl.constexpr, NCHUNK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    ok = cols < V
    x = tl.load(L + row * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
    bad = ok & ((x != x) | (tl.abs(x) == float("inf")))
    x = tl.where(x != x, float("-inf"), x)  # the sampler's nan_to_num: NaN never wins,
    x = tl.where(x == float("inf"), _FLOAT_MAX, x)  # +inf becomes the largest float
    best, index = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    out = row * NCHUNK + c
    tl.store(Best + out, best)
    tl.store(Index + out, c * CHUNK + index)
    tl.store(Bad + out, tl.max(bad.to(tl.int32), 0))


@triton.jit
def _greedy_merge_kernel(Best, Index, Bad, Tokens, Picks, NCHUNK: tl.constexpr, PAD: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, PAD)
    ok = c < NCHUNK
    best = tl.load(Best + row * NCHUNK + c, mask=ok, other=float("-inf"))
    index = tl.load(Index + row * NCHUNK + c, mask=ok, other=0)
    bad = tl.load(Bad + row * NCHUNK + c, mask=ok, other=0)
    _, at = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
    pick = tl.sum(tl.where(c == at, index, 0), 0).to(tl.int64)  # chunks are in column order:
    tl.store(Picks + row, pick)  # the first chunk holding the maximum holds its first index
    tl.store(Tokens + row, tl.where(tl.max(bad, 0) > 0, -1, pick))


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens of logits [B, V] in two passes: (token ids [B] int64, -1 where a row holds
    NaN/inf; picks [B], the first index of each row's maximum after NaN -> -inf, +inf -> max)."""
    b, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    nchunk = triton.cdiv(v, GREEDY_CHUNK)
    best = torch.empty((b, nchunk), dtype=torch.float32, device=logits.device)
    index = torch.empty((b, nchunk), dtype=torch.int32, device=logits.device)
    bad = torch.empty((b, nchunk), dtype=torch.int32, device=logits.device)
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    picks = torch.empty(b, dtype=torch.int64, device=logits.device)
    _greedy_chunk_kernel[(b, nchunk)](logits, best, index, bad, logits.stride(0), v,
                                      CHUNK=GREEDY_CHUNK, NCHUNK=nchunk, num_warps=4,
                                      **launch_args(logits.device))  # fmt: skip
    _greedy_merge_kernel[(b,)](best, index, bad, tokens, picks, NCHUNK=nchunk,
                               PAD=triton.next_power_of_2(nchunk), num_warps=1,
                               **launch_args(logits.device))  # fmt: skip
    return tokens, picks
