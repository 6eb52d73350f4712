"""Mixture-of-experts blocks over HF-layout expert weights (gpt-oss and Qwen3-MoE routing).

Why the HF layouts: models load checkpoints by name with no transposes, so the weights here are
exactly transformers 5.24's parameters:
- GptOssExperts: gate_up_proj [E, H, 2I] (gate/up interleaved: ::2 / 1::2), gate_up_proj_bias
  [E, 2I], down_proj [E, I, H], down_proj_bias [E, H]; router weight [E, H], bias [E].
- Qwen3MoeExperts: gate_up_proj [E, 2I, H] (gate = first I rows), down_proj [E, H, I]; router
  (`mlp.gate.weight`) [E, H].
Compute is grouped per hit expert (one matmul per expert over the tokens routed to it), which
reads each needed expert's weights once per step: the right shape for decode, where a token
touches top_k of E experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.quant.mxfp4 import Mxfp4Experts, moe_gpt_oss_mxfp4


def _route_groups(top_idx: torch.Tensor, num_experts: int):
    """Yield (expert, token rows, slot in top-k) for each expert hit this step."""
    flat = top_idx.reshape(-1)  # [T * k]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    k = top_idx.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        sel = order[start : start + count]
        start += count
        yield expert, sel // k, sel % k


def check_tokens(name: str, x: torch.Tensor, top_k: int, num_experts: int) -> None:
    """Reject x that is not [T, H] or top_k outside [1, num_experts] (shared with the MLX MoE)."""
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [T, H]; got {tuple(x.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{name}: top_k must be in [1, {num_experts}]; got {top_k}")


def moe_gpt_oss(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    *,
    top_k: int,
    limit: float = 7.0,
    alpha: float = 1.702,
) -> torch.Tensor:
    """gpt-oss MoE: top-k of router logits, softmax over those k, clamped SwiGLU experts.

    x [T, H] -> [T, H] in x's dtype. Expert output: (clamp(up, -limit, limit) + 1) *
    g * sigmoid(alpha * g) with g = clamp(gate, max=limit).
    """
    check_tokens("moe_gpt_oss", x, top_k, router_weight.shape[0])
    if isinstance(gate_up_proj, Mxfp4Experts):  # packed MXFP4 experts: ops/quant/mxfp4.py
        return moe_gpt_oss_mxfp4(
            x, router_weight, router_bias, gate_up_proj, gate_up_proj_bias, down_proj,
            down_proj_bias, top_k=top_k, limit=limit, alpha=alpha,
        )  # fmt: skip
    logits = F.linear(x, router_weight, router_bias)  # [T, E]
    top_val, top_idx = torch.topk(logits, top_k, dim=-1)  # [T, k]
    scores = torch.softmax(top_val, dim=-1)
    out = torch.zeros_like(x)
    for expert, rows, slots in _route_groups(top_idx, router_weight.shape[0]):
        h = x[rows] @ gate_up_proj[expert] + gate_up_proj_bias[expert]  # [t, 2I]
        gate = h[:, ::2].clamp(max=limit)
        up = h[:, 1::2].clamp(min=-limit, max=limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * alpha))  # [t, I]
        y = h @ down_proj[expert] + down_proj_bias[expert]  # [t, H]
        out.index_add_(0, rows, (y * scores[rows, slots, None]).to(x.dtype))
    return out


def moe_qwen3(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    top_k: int,
    norm_topk_prob: bool,
) -> torch.Tensor:
    """Qwen3-MoE: softmax over all router logits (fp32), top-k, optional renormalisation, SiLU
    experts. x [T, H] -> [T, H] in x's dtype."""
    check_tokens("moe_qwen3", x, top_k, gate_weight.shape[0])
    logits = F.linear(x, gate_weight)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_val, top_idx = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if norm_topk_prob:
        top_val = top_val / top_val.sum(dim=-1, keepdim=True)
    scores = top_val.to(logits.dtype)
    inter = down_proj.shape[2]
    out = torch.zeros_like(x)
    for expert, rows, slots in _route_groups(top_idx, gate_weight.shape[0]):
        h = F.linear(x[rows], gate_up_proj[expert])  # [t, 2I]
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, down_proj[expert])  # [t, H]
        out.index_add_(0, rows, (y * scores[rows, slots, None]).to(x.dtype))
    return out
