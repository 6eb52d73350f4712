"""MoE experts under tensor parallel: split within every expert (the default) or whole experts
per rank (expert parallel, `enable_expert_parallel`); dense or packed MXFP4 (gpt-oss).

Within: each rank holds every expert's 1/N slice of the intermediate dimension (gate/up rows,
down columns; MXFP4 down blocks cut at 32-element block boundaries), so each expert's output is
a partial sum. Expert parallel: rank r holds experts [r E/N, (r+1) E/N) whole, computes only the
token/expert pairs routed to them (ops.routing.local_experts) and its output is that part. The
router is replicated either way (every rank routes each token alike) and one all-reduce sums the
ranks' outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from models import gpt_oss, qwen3_moe
from ops.quant.mxfp4 import GROUP_SIZE as MXFP4_GROUP


def shard_experts(plan, name: str, moe: nn.Module) -> None:
    """Rewrite `moe`'s meta expert tensors to this rank's part and record their slices."""
    if plan.expert_parallel:
        _whole_experts(plan, name, moe)
    elif isinstance(moe, qwen3_moe.SparseMoeBlock):
        _within_qwen3(plan, name, moe)
    else:
        _within_gpt_oss(plan, name, moe)


def _resize(module: nn.Module, attr: str, dim: int, size: int) -> None:
    old = getattr(module, attr)
    shape = list(old.shape)
    shape[dim] = size
    new = torch.empty(shape, dtype=old.dtype, device="meta")
    if attr in module._buffers:
        module.register_buffer(attr, new)
    else:
        setattr(module, attr, nn.Parameter(new))


def _whole_experts(plan, name: str, moe: nn.Module) -> None:
    ex, prefix = moe.experts, f"{name}.experts"
    tensors = [n for n, _ in ex.named_parameters(recurse=False)]
    tensors += [n for n, _ in ex.named_buffers(recurse=False)]
    num = getattr(ex, tensors[0]).shape[0]
    local = num // plan.size
    start = plan.rank * local
    for attr in tensors:  # every expert tensor is [E, ...]: this rank's experts, whole
        plan.slices[f"{prefix}.{attr}"] = narrow(0, start, local)
        _resize(ex, attr, 0, local)
    if isinstance(moe, gpt_oss.MoE) and not ex.is_packed:  # MXFP4 dequantized at load
        _packed_sources(plan, prefix, {"gate_up_proj": (0, start, local),
                                       "down_proj": (0, start, local)})  # fmt: skip
    if start:
        moe.expert_parallel = {"expert_start": start}
    plan.num_local_experts = local
    for e in range(num):  # Hub per-expert tensors (qwen3_moe): this rank's, renumbered from 0
        for proj in ("gate_proj", "up_proj", "down_proj"):
            local_e = e - start
            new = f"{prefix}.{local_e}.{proj}.weight" if 0 <= local_e < local else None
            plan.raw_renames[f"{prefix}.{e}.{proj}.weight"] = new


def _within_qwen3(plan, name: str, moe: nn.Module) -> None:
    ex, prefix = (
        moe.experts,
        f"{name}.experts",
    )  # gate_up [E, 2I, H] (gate, then up), down [E, H, I]
    inter = ex.down_proj.shape[2]
    size = inter // plan.size
    start = plan.rank * size
    plan.slices[f"{prefix}.gate_up_proj"] = lambda t: torch.cat(
        [t.narrow(1, start, size), t.narrow(1, inter + start, size)], dim=1
    )
    plan.slices[f"{prefix}.down_proj"] = narrow(2, start, size)
    stacked = (f"{prefix}.gate_up_proj", f"{prefix}.down_proj")
    for e in range(ex.down_proj.shape[0]):  # Hub checkpoints: one tensor per expert
        for proj, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            plan.raw_slices[f"{prefix}.{e}.{proj}.weight"] = (narrow(dim, start, size), stacked)
    _resize(ex, "gate_up_proj", 1, 2 * size)
    _resize(ex, "down_proj", 2, size)


def _within_gpt_oss(plan, name: str, moe: nn.Module) -> None:
    """Dense: gate_up [E, H, 2I] interleaved (gate, up) pairs, down [E, I, H]. Packed MXFP4:
    gate_up blocks [E, 2I, H/32, 16] (rows interleaved alike), down blocks [E, H, I/32, 16]:
    the down slice is whole 32-element blocks (checks.check_mxfp4_shards)."""
    ex, prefix = moe.experts, f"{name}.experts"
    inter = ex.gate_up_proj_bias.shape[1] // 2
    size = inter // plan.size
    start = plan.rank * size
    if ex.is_packed:
        cuts = {
            "gate_up_proj_blocks": (1, 2 * start, 2 * size),
            "gate_up_proj_scales": (1, 2 * start, 2 * size),
            "down_proj_blocks": (2, start // MXFP4_GROUP, size // MXFP4_GROUP),
            "down_proj_scales": (2, start // MXFP4_GROUP, size // MXFP4_GROUP),
        }
    else:
        cuts = {"gate_up_proj": (2, 2 * start, 2 * size), "down_proj": (1, start, size)}
        aligned = {"gate_up_proj": (1, 2 * start, 2 * size)}  # MXFP4 sources: their rows
        if size % MXFP4_GROUP == 0:  # else down is dequantized whole and cut after
            aligned["down_proj"] = (2, start // MXFP4_GROUP, size // MXFP4_GROUP)
        _packed_sources(plan, prefix, aligned)
    cuts["gate_up_proj_bias"] = (1, 2 * start, 2 * size)
    for attr, (dim, first, length) in cuts.items():
        plan.slices[f"{prefix}.{attr}"] = narrow(dim, first, length)
        _resize(ex, attr, dim, length)
    plan.rank0_only.add(f"{prefix}.down_proj_bias")  # added once, before the sum


def _packed_sources(plan, prefix: str, cuts: dict) -> None:
    """Dense experts dequantized from an MXFP4 checkpoint (moe_weights="dequantized"): its
    `_blocks` / `_scales` are read as this rank's part (`cuts`: dense name -> the packed tensors'
    (dim, start, length)), so the dense tensor sanitize makes is already the rank's part."""
    for base, (dim, first, length) in cuts.items():
        for suffix in ("_blocks", "_scales"):
            plan.slices[f"{prefix}.{base}{suffix}"] = narrow(dim, first, length)
        plan.presliced.add(f"{prefix}.{base}")


def rename_raw(plan, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Expert parallel over per-expert Hub tensors: keep this rank's experts, renumbered."""
    if not plan.raw_renames:
        return weights
    out = {}
    for name, tensor in weights.items():
        if name not in plan.raw_renames:
            out[name] = tensor
            continue
        prefix = name.rsplit(".", 3)[0]  # <layer>.mlp.experts: the stacked tensors sanitize makes
        for stacked in ("gate_up_proj", "down_proj"):  # are already this rank's experts
            plan.slices.pop(f"{prefix}.{stacked}", None)
        if (new := plan.raw_renames[name]) is not None:
            out[new] = tensor
    return out


def narrow(dim: int, start: int, length: int, pad: int = 0):
    """tensor -> tensor.narrow(dim, start, length), then `pad` zero rows along `dim`."""

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        part = tensor.narrow(dim, start, length)
        if not pad:
            return part
        shape = list(part.shape)
        shape[dim] = pad
        return torch.cat([part, part.new_zeros(shape)], dim=dim)

    cut.spec = (dim, start, length, pad)  # shard-aware reading (slice_read.py) reads just this
    return cut


MOE_MODULES = (qwen3_moe.SparseMoeBlock, gpt_oss.MoE)
