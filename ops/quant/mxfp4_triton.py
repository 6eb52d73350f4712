"""CUDA: the gpt-oss expert matmuls read MXFP4 bytes directly (Triton), with no host sync.

Why this shape: a decode step routes T tokens to top_k experts each. The (token, slot) pairs are
sorted by expert and each expert's run padded to a multiple of BLOCK_M, into a buffer of the
largest size any routing can need (T*k + min(E, T*k) * (BLOCK_M - 1) slots). Every kernel
program owns BLOCK_M slots of one expert and BLOCK_N output columns, so each routed expert's
weights are read once per step, and a program past the real end reads a device counter and
returns. All shapes depend on T alone, so a CUDA graph captures the whole MoE.

Inside a program: the bytes of a [BLOCK_N, BLOCK_K / 2] tile are split into low nibbles (even
input columns) and high nibbles (odd columns), decoded as E2M1 times 2^(s - 127) in fp32, cast
to the activation dtype (exact: every MXFP4 value fits bf16) and multiplied with the matching
even / odd activation columns; accumulation is fp32, bias added before the one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.quant.mxfp4 import GROUP_SIZE, Mxfp4Experts, swiglu

# (BLOCK_N, BLOCK_K, num_warps, num_stages) by the step's shape, from `tools/bench_mxfp4.py op
# --sweep` on the H200 (gpt-oss-20b layer, CUDA graph): one token is best with narrow column
# tiles (more programs for 4 experts), 8-64 tokens with wide ones (each byte decoded once for
# more rows). BLOCK_M 64 (prefill) was not swept.
CONFIGS = {"one_token": (32, 128, 4, 3), 16: (128, 128, 4, 3), 64: (64, 128, 4, 3)}


@triton.jit
def _decode_e2m1(code, scale):
    """FP4 E2M1 codes (int32 0..15) times fp32 scales -> fp32 values."""
    exp = (code >> 1) & 3
    man = (code & 1).to(tl.float32)
    normal = (1 << exp).to(tl.float32) * (0.5 + 0.25 * man)  # 2^(exp-1) * (1 + man/2)
    mag = tl.where(exp == 0, 0.5 * man, normal)
    return tl.where((code & 8) != 0, -mag, mag) * scale


@triton.jit
def _mxfp4_expert_matmul(
    a_ptr,
    blocks_ptr,
    scales_ptr,
    bias_ptr,
    out_ptr,
    slot_pair_ptr,  # [S] pair id (token * top_k + slot) held by each sorted slot; num_pairs = empty
    block_expert_ptr,  # [S / BLOCK_M] expert of each block of slots
    num_slots_used_ptr,  # [1] slots in use (the end of the last expert's padded run)
    num_pairs,
    top_k,
    N,
    K,
    stride_am,
    stride_om,
    A_ROWS_BY_SLOT: tl.constexpr,  # False: row = token of the pair (gate_up); True: row = slot (down)
    OUT_ROWS_BY_SLOT: tl.constexpr,  # True: out row = slot (gate_up); False: out row = pair id (down)
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_slots_used_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(slot_pair_ptr + slots)
    is_real = pairs < num_pairs
    a_rows = slots if A_ROWS_BY_SLOT else pairs // top_k
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < N
    half = tl.arange(0, BLOCK_K // 2)
    row_bytes = K // 2
    b_base = blocks_ptr + expert * N * row_bytes + cols[:, None].to(tl.int64) * row_bytes
    s_base = scales_ptr + expert * N * (K // 32) + cols[:, None].to(tl.int64) * (K // 32)
    a_base = a_ptr + a_rows[:, None].to(tl.int64) * stride_am
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        byte_idx = k0 // 2 + half  # [BK/2]
        is_k = byte_idx < row_bytes
        w_mask = is_col[:, None] & is_k[None, :]
        packed = tl.load(b_base + byte_idx[None, :], mask=w_mask, other=0).to(tl.int32)
        exps = tl.load(s_base + (byte_idx // 16)[None, :], mask=w_mask, other=127).to(tl.int32)
        scale = (exps << 23).to(tl.float32, bitcast=True)  # 2^(s - 127)
        a_mask = is_real[:, None] & is_k[None, :]
        a_even = tl.load(a_base + 2 * byte_idx[None, :], mask=a_mask, other=0.0)
        a_odd = tl.load(a_base + 2 * byte_idx[None, :] + 1, mask=a_mask, other=0.0)
        w_even = _decode_e2m1(packed & 15, scale).to(a_even.dtype)  # [BN, BK/2]
        w_odd = _decode_e2m1(packed >> 4, scale).to(a_even.dtype)
        if IEEE:
            acc += tl.dot(a_even, tl.trans(w_even), input_precision="ieee")
            acc += tl.dot(a_odd, tl.trans(w_odd), input_precision="ieee")
        else:
            acc += tl.dot(a_even, tl.trans(w_even))
            acc += tl.dot(a_odd, tl.trans(w_odd))
    bias = tl.load(bias_ptr + expert * N + cols, mask=is_col, other=0.0).to(tl.float32)
    acc += bias[None, :]
    out_rows = slots if OUT_ROWS_BY_SLOT else pairs
    out_mask = is_real[:, None] & is_col[None, :]
    out_ptrs = out_ptr + out_rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def block_m_for(num_pairs: int) -> int:
    """Rows per program: 16 (tl.dot's minimum) for decode-sized batches, 64 for prefill."""
    return 16 if num_pairs <= 256 else 64


def align_by_expert(top_idx: torch.Tensor, num_experts: int, block_m: int):
    """Sort (token, slot) pairs by expert into padded runs; device tensors only, no host sync.

    Returns slot_pair [S] (pair id per slot; num_pairs marks padding), block_expert [S/BLOCK_M]
    and num_slots_used [1], with S = the bound for any routing of these T tokens.
    """
    num_pairs = top_idx.numel()
    flat = top_idx.reshape(-1)  # [P] expert of each pair
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # pair ids sorted by expert
    sorted_expert = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - run_start[sorted_expert]
    dest = padded_end[sorted_expert] - padded[sorted_expert] + rank
    num_slots = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_slots = (num_slots + block_m - 1) // block_m * block_m
    slot_pair = torch.full((num_slots,), num_pairs, dtype=torch.int32, device=flat.device)
    slot_pair[dest] = order.to(torch.int32)
    block_start = torch.arange(0, num_slots, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    return slot_pair, block_expert, padded_end[-1:]


def expert_matmul(
    a: torch.Tensor,
    packed: Mxfp4Experts,
    bias: torch.Tensor,
    routing,
    *,
    num_pairs: int,
    top_k: int,
    block_m: int,
    a_rows_by_slot: bool,
    config: tuple[int, int, int, int] | None = None,
):
    """One routed MXFP4 matmul: rows of `a` (tokens or slots) @ W[expert].T + bias[expert]."""
    slot_pair, block_expert, num_slots_used = routing
    key = "one_token" if block_m == 16 and num_pairs <= top_k else block_m
    block_n, block_k, num_warps, num_stages = config or CONFIGS[key]
    if not (packed.blocks.is_contiguous() and packed.scales.is_contiguous()):
        raise ValueError("moe_gpt_oss: MXFP4 blocks and scales must be contiguous")
    n, k = packed.out_features, packed.in_features
    out_rows = num_pairs if a_rows_by_slot else slot_pair.shape[0]
    out = torch.empty(out_rows, n, dtype=a.dtype, device=a.device)
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _mxfp4_expert_matmul[grid](
        a,
        packed.blocks,
        packed.scales,
        bias,
        out,
        slot_pair,
        block_expert,
        num_slots_used,
        num_pairs,
        top_k,
        n,
        k,
        a.stride(0),
        out.stride(0),
        A_ROWS_BY_SLOT=a_rows_by_slot,
        OUT_ROWS_BY_SLOT=not a_rows_by_slot,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def moe_experts_mxfp4(
    x: torch.Tensor,
    top_idx: torch.Tensor,
    gate_up: Mxfp4Experts,
    gate_up_bias: torch.Tensor,
    down: Mxfp4Experts,
    down_bias: torch.Tensor,
    limit: float,
    alpha: float,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [T, H], top_idx [T, k] -> each pair's expert output [T, k, H] (before the router weights)."""
    if gate_up.in_features % GROUP_SIZE or down.in_features % GROUP_SIZE:
        raise ValueError("moe_gpt_oss: MXFP4 in-features must be multiples of 32")
    num_tokens, top_k = top_idx.shape
    num_pairs = num_tokens * top_k
    block_m = block_m_for(num_pairs)
    routing = align_by_expert(top_idx, gate_up.num_experts, block_m)
    x = x.contiguous()
    common = {"num_pairs": num_pairs, "top_k": top_k, "block_m": block_m, "config": config}
    h = expert_matmul(x, gate_up, gate_up_bias, routing, a_rows_by_slot=False, **common)  # [S, 2I]
    h = swiglu(h, limit, alpha).contiguous()  # [S, I]; padding rows hold garbage, never read out
    y = expert_matmul(h, down, down_bias, routing, a_rows_by_slot=True, **common)  # [P, H]
    return y.view(num_tokens, top_k, -1)
