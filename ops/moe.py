"""Mixture-of-experts blocks over HF-layout expert weights (gpt-oss and Qwen3-MoE routing).

Why the HF layouts: models load checkpoints by name with no transposes, so the weights here are
exactly transformers 5.24's parameters:
- GptOssExperts: gate_up_proj [E, H, 2I] (gate/up interleaved: ::2 / 1::2), gate_up_proj_bias
  [E, 2I], down_proj [E, I, H], down_proj_bias [E, H]; router weight [E, H], bias [E].
- Qwen3MoeExperts: gate_up_proj [E, 2I, H] (gate = first I rows), down_proj [E, H, I]; router
  (`mlp.gate.weight`) [E, H].
Each family routes (router logits -> top-k ids and weights) and then runs its experts through
one of two formulations with the same maths:
- `_looped_experts` (CPU, the reference): one matmul per hit expert over the tokens routed to
  it. It reads each needed expert once, but finding the hit experts reads counts on the host.
- `_grouped_experts` (CUDA, bf16): token/expert pairs sorted by expert, two
  `torch._grouped_mm` calls over row offsets that stay on the device. No host sync, fixed
  shapes for a given token count, so a decode step with MoE layers can be captured in a CUDA
  graph. Other CUDA dtypes take `_dense_experts` (every expert on every token, also sync-free).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ops.activation import clamped_swiglu, silu_mul
from ops.linear import linear
from ops.quant.mxfp4 import Mxfp4Experts, moe_gpt_oss_mxfp4
from ops.routing import local_experts, route_groups

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _looped_experts(x, top_idx, scores, w_in, b_in, w_out, b_out, act, *, transposed: bool):
    """Reference: per hit expert, act(x W_in + b_in) W_out + b_out, scaled and summed.

    w_in [E, H, 2I] ([E, 2I, H] when `transposed`, HF's F.linear layout), w_out likewise."""
    out = torch.zeros_like(x)
    for expert, rows, slots in route_groups(top_idx, w_in.shape[0]):
        if transposed:
            h = act(F.linear(x[rows], w_in[expert]))  # [t, I]
            y = F.linear(h, w_out[expert])  # [t, H]
        else:
            h = act(x[rows] @ w_in[expert] + b_in[expert])
            y = h @ w_out[expert] + b_out[expert]
        out.index_add_(0, rows, (y * scores[rows, slots, None]).to(x.dtype))
    return out


def _grouped_experts(x, top_idx, scores, w_in, b_in, w_out, b_out, act, *, transposed: bool):
    """The same sum as `_looped_experts` with no host sync (see the module docstring)."""
    t, k = top_idx.shape
    num_experts = w_in.shape[0]
    flat = top_idx.reshape(-1)  # [T * k]
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.to(torch.int32), torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end row of each group
    experts = flat[order]  # [T * k] expert of each sorted pair
    if transposed:  # HF F.linear layout [E, out, in] -> [E, in, out] views (column-major)
        w_in, w_out = w_in.transpose(1, 2), w_out.transpose(1, 2)
    h = torch._grouped_mm(x[order // k], w_in, offs=offsets)  # [T * k, 2I]
    h = act(h) if b_in is None else act(h, b_in, experts)  # the bias add fused in the act
    y = torch._grouped_mm(h.to(x.dtype), w_out, offs=offsets)  # [T * k, H]
    if b_out is not None:
        y = y + b_out[experts]
    y = y * scores.reshape(-1)[order, None]
    pairs = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, slot) order
    return pairs.view(t, k, -1).sum(dim=1).to(x.dtype)  # [T, H], fixed summation order


def _dense_experts(x, top_idx, scores, w_in, b_in, w_out, b_out, act, *, transposed: bool):
    """Every expert on every token, weighted by the routing (zero off the top-k): E/k times the
    FLOPs, no host sync. For CUDA dtypes the grouped GEMM does not take in a capturable way
    (its fp32 fallback reads the offsets on the host): fp32 tests and small models."""
    t, e = x.shape[0], w_in.shape[0]
    if transposed:
        w_in, w_out = w_in.transpose(1, 2), w_out.transpose(1, 2)
    h = torch.matmul(x[None], w_in)  # [E, T, 2I]
    if b_in is not None:
        h = h + b_in[:, None]
    h = act(h.reshape(e * t, -1)).view(e, t, -1)  # [E, T, I]
    y = torch.matmul(h, w_out)  # [E, T, H]
    if b_out is not None:
        y = y + b_out[:, None]
    weights = torch.zeros(t, e, dtype=y.dtype, device=x.device)
    # [T, E], zero off the top-k; add, not assign: expert parallel's skipped pairs point at 0
    weights.scatter_add_(1, top_idx, scores.to(y.dtype))
    return torch.einsum("te,eth->th", weights, y).to(x.dtype)


def _experts_for(x: torch.Tensor) -> Callable:
    """The formulation for x: grouped GEMMs for bf16 on CUDA, every expert densely for other
    CUDA dtypes, the reference loop elsewhere."""
    if not x.is_cuda:
        return _looped_experts
    return _grouped_experts if HAS_GROUPED_MM and x.dtype == torch.bfloat16 else _dense_experts


def is_capturable(device: torch.device) -> bool:
    """True when the MoE ops run without a host sync on `device` (CUDA-graph safe)."""
    return torch.device(device).type == "cuda"


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
    expert_start: int = 0,
) -> torch.Tensor:
    """gpt-oss MoE: top-k of router logits, softmax over those k, clamped SwiGLU experts.

    x [T, H] -> [T, H] in x's dtype. Expert output: (clamp(up, -limit, limit) + 1) *
    g * sigmoid(alpha * g) with g = clamp(gate, max=limit). Expert parallel: the expert tensors
    hold experts [expert_start, expert_start + E_local) of the router's; the output is their part.
    """
    check_tokens("moe_gpt_oss", x, top_k, router_weight.shape[0])
    if isinstance(gate_up_proj, Mxfp4Experts):  # packed MXFP4 experts: ops/quant/mxfp4.py
        return moe_gpt_oss_mxfp4(
            x, router_weight, router_bias, gate_up_proj, gate_up_proj_bias, down_proj,
            down_proj_bias, top_k=top_k, limit=limit, alpha=alpha, expert_start=expert_start,
        )  # fmt: skip
    logits = linear(x, router_weight, router_bias)  # [T, E]
    top_val, top_idx = torch.topk(logits, top_k, dim=-1)  # [T, k]
    scores = torch.softmax(top_val, dim=-1)
    if gate_up_proj.shape[0] != router_weight.shape[0]:  # expert parallel
        top_idx, scores = local_experts(top_idx, scores, expert_start, gate_up_proj.shape[0])

    def act(h: torch.Tensor, bias=None, rows=None) -> torch.Tensor:  # [t, 2I] -> [t, I]
        return clamped_swiglu(h, limit, alpha, bias, rows)  # + bias[rows] first, if given

    run = _experts_for(x)
    return run(x, top_idx, scores, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias,
               act, transposed=False)  # fmt: skip


def moe_qwen3(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    top_k: int,
    norm_topk_prob: bool,
    expert_start: int = 0,
) -> torch.Tensor:
    """Qwen3-MoE: softmax over all router logits (fp32), top-k, optional renormalisation, SiLU
    experts. x [T, H] -> [T, H] in x's dtype. expert_start: as in moe_gpt_oss."""
    check_tokens("moe_qwen3", x, top_k, gate_weight.shape[0])
    logits = F.linear(x, gate_weight)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_val, top_idx = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if norm_topk_prob:
        top_val = top_val / top_val.sum(dim=-1, keepdim=True)
    scores = top_val.to(logits.dtype)
    if gate_up_proj.shape[0] != gate_weight.shape[0]:  # expert parallel
        top_idx, scores = local_experts(top_idx, scores, expert_start, gate_up_proj.shape[0])
    run = _experts_for(x)  # act: silu(h[:, :I]) * h[:, I:]
    return run(x, top_idx, scores, gate_up_proj, None, down_proj, None, silu_mul, transposed=True)
