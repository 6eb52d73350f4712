"""MoE routing helper shared by the dense (ops/moe.py) and packed MXFP4 (ops/quant/mxfp4.py) paths."""

from __future__ import annotations

import torch


def route_groups(top_idx: torch.Tensor, num_experts: int):
    """Yield (expert, token rows, slot in top-k) for each expert hit this step.

    The counts go to the host once per call, on purpose: the callers' loops need the hit experts,
    and only those are computed (or dequantised). CPU/MPS reference paths only; the CUDA paths
    never take this branch (no host sync there, so CUDA graphs capture them).
    """
    flat = top_idx.reshape(-1)  # [T * k]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    k = top_idx.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count and expert < num_experts:  # an index past them: another rank's (local_experts)
            sel = order[start : start + count]
            yield expert, sel // k, sel % k
        start += count


def local_experts(top_idx: torch.Tensor, scores: torch.Tensor, start: int, count: int):
    """Expert parallel: this rank holds experts [start, start + count) of the router's E.

    top_idx [T, k] -> local indices; a pair routed to another rank's expert gets weight 0 and
    index `count` on CPU (route_groups skips it: not computed) or 0 on CUDA (fixed shapes, no
    host sync: computed, then zeroed). Summing the ranks' outputs gives the full MoE output."""
    local = top_idx - start
    mine = (local >= 0) & (local < count)
    skip = 0 if top_idx.is_cuda else count
    return torch.where(mine, local, skip), scores * mine.to(scores.dtype)
