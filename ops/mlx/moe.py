"""MLX MoE blocks with ops.moe's signatures: the same routing and per-expert grouping as torch.

Every weight argument may also be a `bridge.MlxTensorView` (from `bridge.borrow_torch_tensors`):
on CPU each crossing otherwise copies all expert weights into MLX (1.6 GB per call for gpt-oss-20b
in bf16), so a model that keeps views of its experts pays that once, at load.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch

from bridge import MlxTensorView, mlx_call
from ops.moe import check_tokens
from ops.quant.mxfp4 import Mxfp4Experts


def _top_k(scores, k: int):
    """Indices and values of the k largest entries per row (order within the k irrelevant)."""
    idx = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]  # [T, k]
    return idx, mx.take_along_axis(scores, idx, axis=-1)


def _grouped(x, idx, scores, num_experts: int, expert_fn):
    """Sum over slots of scores * expert_fn(e, x[rows]), one matmul group per hit expert.

    Reading the routing back to the host (one mid-island eval) lets each expert's weights be
    read once in their own dtype; mx.gather_mm would avoid it but only supports float32 on CPU.
    """
    k = idx.shape[1]
    flat = np.array(idx.reshape(-1))  # [T * k]
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=num_experts)
    out = mx.zeros_like(x)
    start = 0
    for expert in np.nonzero(counts)[0].tolist():
        sel = order[start : start + counts[expert]]
        start += counts[expert]
        rows, slots = mx.array(sel // k), mx.array(sel % k)
        y = expert_fn(expert, x[rows])  # [t, H]
        out = out.at[rows].add((y * scores[rows, slots][:, None]).astype(x.dtype))
    return out


def moe_gpt_oss_mx(
    x, router_weight, router_bias, gate_up, gate_up_bias, down, down_bias, *, top_k, limit, alpha
):
    logits = mx.addmm(router_bias, x, router_weight.T)  # [T, E]; one rounding, as torch
    idx, top = _top_k(logits, top_k)
    scores = mx.softmax(top.astype(mx.float32), axis=-1).astype(x.dtype)  # [T, k]

    def expert(e, xs):
        h = mx.addmm(gate_up_bias[e], xs, gate_up[e])  # [t, 2I]
        gate = mx.minimum(h[:, ::2], limit)
        up = mx.clip(h[:, 1::2], -limit, limit)
        h = (up + 1) * (gate * mx.sigmoid(gate * alpha))  # [t, I]
        return mx.addmm(down_bias[e], h, down[e])  # [t, H]

    return _grouped(x, idx, scores, router_weight.shape[0], expert)


def moe_qwen3_mx(x, gate_weight, gate_up, down, *, top_k: int, norm_topk_prob: bool):
    logits = x @ gate_weight.T  # [T, E]
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    idx, top = _top_k(probs, top_k)
    if norm_topk_prob:
        top = top / top.sum(axis=-1, keepdims=True)
    scores = top.astype(logits.dtype)
    inter = down.shape[2]

    def expert(e, xs):
        h = xs @ gate_up[e].T  # [t, 2I]
        h = mx.sigmoid(h[:, :inter]) * h[:, :inter] * h[:, inter:]  # silu(gate) * up
        return h @ down[e].T  # [t, H]

    return _grouped(x, idx, scores, gate_weight.shape[0], expert)


def _check(name, x, top_k, router):
    if isinstance(router, MlxTensorView):
        router = router.tensor
    check_tokens(name, x, top_k, router.shape[0])


def moe_gpt_oss(
    x: torch.Tensor,
    router_weight,
    router_bias,
    gate_up_proj,
    gate_up_proj_bias,
    down_proj,
    down_proj_bias,
    *,
    top_k: int,
    limit: float = 7.0,
    alpha: float = 1.702,
) -> torch.Tensor:
    """Same contract as ops.moe.moe_gpt_oss; one MLX crossing."""
    _check("moe_gpt_oss", x, top_k, router_weight)
    if isinstance(gate_up_proj, Mxfp4Experts):  # packed experts: MLX's mxfp4 kernels
        from ops.mlx.mxfp4 import moe_gpt_oss_mxfp4

        return moe_gpt_oss_mxfp4(
            x, router_weight, router_bias, gate_up_proj, gate_up_proj_bias, down_proj,
            down_proj_bias, top_k=top_k, limit=limit, alpha=alpha,
        )  # fmt: skip
    return mlx_call(
        moe_gpt_oss_mx,
        x,
        router_weight,
        router_bias,
        gate_up_proj,
        gate_up_proj_bias,
        down_proj,
        down_proj_bias,
        top_k=top_k,
        limit=limit,
        alpha=alpha,
    )


def moe_qwen3(
    x: torch.Tensor, gate_weight, gate_up_proj, down_proj, *, top_k: int, norm_topk_prob: bool
) -> torch.Tensor:
    """Same contract as ops.moe.moe_qwen3; one MLX crossing."""
    _check("moe_qwen3", x, top_k, gate_weight)
    return mlx_call(
        moe_qwen3_mx,
        x,
        gate_weight,
        gate_up_proj,
        down_proj,
        top_k=top_k,
        norm_topk_prob=norm_topk_prob,
    )
