"""CUDA: top-k of the router logits and the softmax over those k, in one Triton launch.

Why: at one token torch.topk over 32 experts is a radix select plus a sort (~8.6 us together on
the H200) and the softmax a third launch, ~0.2 ms of a 24-layer decode step. One program per
token takes the top k by repeated max, ties going to the lowest expert index (the rule the GPU
test pins against torch.topk), and writes the fp32 softmax of the k values. The logits stay the
torch linear's (one cuBLAS call, the reference's rounding); a one-program-per-token Triton
router linear was tried and was slower (16 us: one SM streaming the 184 KB router weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _top_k_softmax(logits_ptr, idx_ptr, score_ptr, stride_l, NUM_EXPERTS: tl.constexpr,
                   E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    is_e = e < NUM_EXPERTS
    logits = tl.load(logits_ptr + token.to(tl.int64) * stride_l + e, mask=is_e, other=0.0)
    logits = tl.where(is_e, logits.to(tl.float32), float("-inf"))
    slots = tl.arange(0, K_PAD)
    top = tl.full([K_PAD], float("-inf"), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(logits, axis=0)
        pick = tl.min(tl.where(logits == best, e, E_PAD), axis=0)  # lowest index among ties
        tl.store(idx_ptr + token * TOP_K + slot, pick)
        top = tl.where(slots == slot, best, top)
        logits = tl.where(e == pick, float("-inf"), logits)
    weights = tl.exp(top - tl.max(top, axis=0))
    weights = weights / tl.sum(weights, axis=0)
    tl.store(score_ptr + token * TOP_K + slots, weights, mask=slots < TOP_K)


def top_k_softmax(logits: torch.Tensor, top_k: int):
    """logits [T, E] -> (top_idx [T, k] int32, scores [T, k] fp32): torch.topk then softmax."""
    num_tokens, num_experts = logits.shape
    top_idx = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    scores = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    _top_k_softmax[(num_tokens,)](
        logits, top_idx, scores, logits.stride(0), NUM_EXPERTS=num_experts,
        E_PAD=triton.next_power_of_2(num_experts), TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), num_warps=1,
    )  # fmt: skip
    return top_idx, scores
