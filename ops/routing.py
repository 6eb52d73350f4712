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
        if count:
            sel = order[start : start + count]
            yield expert, sel // k, sel % k
        start += count
