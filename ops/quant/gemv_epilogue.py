"""What the one-row GEMV (ops/quant/gemv_triton.py) does with its fp32 sums: store them, or fold
the kernel that would read them next into the store (one launch a layer fewer, same values).

- GATED: [gate, up] column pairs -> silu(gate) * up (the SiLU-mul kernel's rounding).
- ROPE: a q/k/v projection's columns as (d, d + D / 2) pairs of a head -> rope on q and k with
  the rope rows of each token, q stored to `out` [M, Hq * D], k and v written to the paged pool
  at the token's slot: the values of `_rope_kv_kernel` (ops/fused) reading the GEMV's output,
  provided the launch turns FMA contraction off as that kernel's does (gemv_triton.gemv does).

Why the pairs: a program's tile holds whole (d, d + D / 2) pairs, so rotate-half needs no data
from another program, no sync: the same trick as the gated tile's (gate, up) pairs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ops.fused.triton_kernels import rope_pair_values, silu_mul_values


@triton.jit
def tile_rows(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr, ROPE: tl.constexpr,
              HALF: tl.constexpr):  # fmt: skip
    """The weight rows of program pid_n's tile [BLOCK_N] and which are real: consecutive rows;
    GATED: gate row c, up row c (= c + N / 2), ... for its BLOCK_N / 2 channels; ROPE: row
    h * D + j, then h * D + j + HALF, for its BLOCK_N / 2 pairs (h, j) in pair order."""
    if GATED:
        pair = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2  # the output channel
        rn = pair + (tl.arange(0, BLOCK_N) % 2) * (N // 2)  # gate row, up row, gate row, ...
        n_ok = pair < N // 2
    elif ROPE:
        pair = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        rn = (pair // HALF) * (2 * HALF) + pair % HALF + (tl.arange(0, BLOCK_N) % 2) * HALF
        n_ok = pair < N // 2
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N  # uniform along a row: the 16-byte loads stay vectorised
    return rn, n_ok


@triton.jit
def store(out_ptr, out_ptrs, value, out_ok, pid_n, rm, m_ok, N, stride_om, cos_ptr, sin_ptr,
          slots_ptr, k_ptr, v_ptr, stride_ct, stride_st, stride_slot, stride_ks, stride_kh,
          stride_vs, stride_vh, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          GATED: tl.constexpr, ROPE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
          HALF: tl.constexpr):  # fmt: skip
    """The fp32 results [BLOCK_M, BLOCK_N] rounded to the output dtype, stored (GATED, ROPE:
    see the module docstring; the rope rows, slots and pools are read by ROPE only)."""
    dtype = out_ptr.dtype.element_ty
    value = value.to(dtype)
    if GATED:
        gate, up = tl.split(tl.reshape(value, (BLOCK_M, BLOCK_N // 2, 2)))
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        ptrs = out_ptr + rm[:, None] * stride_om + cols[None, :]
        ok = m_ok[:, None] & (cols < N // 2)[None, :]
        tl.store(ptrs, silu_mul_values(gate, up, dtype), mask=ok)
    elif ROPE:
        _store_rope_kv(out_ptr, value, pid_n, rm, m_ok, N, stride_om, cos_ptr, sin_ptr,
                       slots_ptr, k_ptr, v_ptr, stride_ct, stride_st, stride_slot, stride_ks,
                       stride_kh, stride_vs, stride_vh, BLOCK_M, BLOCK_N, HQ, HKV, HALF)  # fmt: skip
    else:
        tl.store(out_ptrs, value, mask=out_ok)


@triton.jit
def _store_rope_kv(q_ptr, value, pid_n, rm, m_ok, N, stride_qm, cos_ptr, sin_ptr, slots_ptr,
                   k_ptr, v_ptr, stride_ct, stride_st, stride_slot, stride_ks, stride_kh,
                   stride_vs, stride_vh, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """value: the rounded q/k/v sums, (d, d + HALF) column pairs. q and k heads rotate by the
    rope rows [M, 2 HALF] (cos, signed sin) of their token; q -> q_ptr [M, HQ * 2 HALF], k and
    v -> the pools [slots, HKV, 2 HALF] at slots[m]."""
    dtype = q_ptr.dtype.element_ty
    lo, hi = tl.split(tl.reshape(value, (BLOCK_M, BLOCK_N // 2, 2)))  # column d, column d + HALF
    pair = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    head, j = pair // HALF, pair % HALF
    ok = m_ok[:, None] & (pair < N // 2)[None, :]
    turns = ok & (head < HQ + HKV)[None, :]  # q and k heads
    c_row, s_row = cos_ptr + rm[:, None] * stride_ct, sin_ptr + rm[:, None] * stride_st
    c_lo = tl.load(c_row + j[None, :], mask=turns, other=1.0)
    c_hi = tl.load(c_row + j[None, :] + HALF, mask=turns, other=1.0)
    s_lo = tl.load(s_row + j[None, :], mask=turns, other=0.0)
    s_hi = tl.load(s_row + j[None, :] + HALF, mask=turns, other=0.0)
    turned_lo, turned_hi = rope_pair_values(lo, hi, c_lo, s_lo, c_hi, s_hi, dtype)
    lo = tl.where(turns, turned_lo.to(dtype), lo)  # v heads keep their bits (signed zeros too)
    hi = tl.where(turns, turned_hi.to(dtype), hi)
    slot = tl.load(slots_ptr + rm * stride_slot, mask=m_ok, other=0).to(tl.int64)[:, None]
    is_q = ok & (head < HQ)[None, :]
    q_at = q_ptr + rm[:, None] * stride_qm + (head * (2 * HALF) + j)[None, :]
    tl.store(q_at, lo, mask=is_q)
    tl.store(q_at + HALF, hi, mask=is_q)
    is_k = ok & ((head >= HQ) & (head < HQ + HKV))[None, :]
    k_at = k_ptr + slot * stride_ks + ((head - HQ) * stride_kh + j)[None, :]
    tl.store(k_at, lo.to(k_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_at + HALF, hi.to(k_ptr.dtype.element_ty), mask=is_k)
    is_v = ok & (head >= HQ + HKV)[None, :]
    v_at = v_ptr + slot * stride_vs + ((head - HQ - HKV) * stride_vh + j)[None, :]
    tl.store(v_at, lo.to(v_ptr.dtype.element_ty), mask=is_v)
    tl.store(v_at + HALF, hi.to(v_ptr.dtype.element_ty), mask=is_v)


class RopeKvTarget(NamedTuple):
    """Where a ROPE GEMV puts a q/k/v projection of M decode tokens: the rope rows cos /
    signed_sin [M, D] (`rope_tables`, full rotary), q -> the returned [M, Hq * D], k and v ->
    k_pool / v_pool [slots, Hkv, D] at slots [M] (ops/rope.rope_kv_write's arguments)."""

    cos: torch.Tensor
    signed_sin: torch.Tensor
    slots: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    num_q_heads: int

    def check(self, x: torch.Tensor, n: int) -> None:
        """A clear error for a target the kernel cannot take (names the mismatch)."""
        _, hkv, d = self.k_pool.shape
        if n != (self.num_q_heads + 2 * hkv) * d or d % 2:
            raise ValueError(
                f"gemv rope: weight rows {n} != (Hq + 2 Hkv) * D = ({self.num_q_heads} + 2 * "
                f"{hkv}) * {d} (D even), from the pool [slots, Hkv, D] {tuple(self.k_pool.shape)}"
            )
        if self.cos.shape[-1] != d or self.signed_sin.shape[-1] != d:
            raise ValueError(
                f"gemv rope: rope rows must rotate all D={d} dims; got cos "
                f"{tuple(self.cos.shape)}, signed_sin {tuple(self.signed_sin.shape)}"
            )
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"gemv rope: x must be bf16 or fp16; got {x.dtype}")
        if not self.is_dense():
            raise ValueError("gemv rope: the pools' and the rope rows' last dim must be contiguous")

    def is_dense(self) -> bool:
        """Whether the pools and the rope rows are contiguous along D (the store's addressing)."""
        tensors = (self.k_pool, self.v_pool, self.cos, self.signed_sin)
        return all(t.stride(-1) == 1 for t in tensors)

    def launch_args(self) -> dict:
        """_gemv's ROPE keyword arguments (pointers, strides, head counts)."""
        k, v = self.k_pool, self.v_pool
        return dict(cos_ptr=self.cos, sin_ptr=self.signed_sin, slots_ptr=self.slots, k_ptr=k,
                    v_ptr=v, stride_ct=self.cos.stride(0), stride_st=self.signed_sin.stride(0),
                    stride_slot=self.slots.stride(0), stride_ks=k.stride(0),
                    stride_kh=k.stride(1), stride_vs=v.stride(0), stride_vh=v.stride(1),
                    ROPE=True, HQ=self.num_q_heads, HKV=k.shape[1], HALF=k.shape[2] // 2)  # fmt: skip
