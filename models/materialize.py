"""Fill a meta model from checked checkpoint tensors, one tensor at a time, so a load peaks near
the weights it keeps (1/N of them on a tensor-parallel rank) plus one tensor.

Three copies a naive load makes are avoided: (1) the memory-mapped file pages, which count in the
process's resident memory next to any copy taken from them: a tensor the loader still holds as
read from the file is read again with pread into its own memory (safetensors_io.FileTensor), so
no mapped page is ever touched; (2) the q/k/v and gate/up concatenation: the fused buffers are
allocated first (layers.allocate_fused) and each part is copied straight into its slice; (3) the
dict of cast tensors next to the originals: each source is dropped as soon as it is copied.
Tensors a family's sanitize builds from several (Qwen3-MoE's per-expert stacks, dequantized
MXFP4 experts) arrive as meta tensors whose origin reads the parts into one new buffer
(safetensors_io.StackedRead, mxfp4.DequantizedRead), so (1) holds for them too.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from models import weight_checks
from models.errors import ModelLoadError
from models.quantize import return_freed_memory
from models.safetensors_io import SCRATCH_BYTES, Origins


def materialize(
    model: nn.Module,
    weights: dict[str, torch.Tensor],
    origins: Origins,
    device: torch.device,
    dtype: torch.dtype,
    *,
    keep_dtype: frozenset[str] | set[str] = frozenset(),
    check_finite: bool = True,
    desc: str = "Loading",
) -> None:
    """Assign every tensor of `weights` (emptied as it goes) to the meta `model`'s parameter of
    that name: floating tensors cast to `dtype` (except `keep_dtype`: fp8 weights kept as
    e4m3), on `device`, each checked finite after its cast (models/weight_checks.py)."""
    targets = {
        name: (t.dtype if name in keep_dtype or not t.is_floating_point() else dtype)
        for name, t in weights.items()
    }
    views = _allocate_fused(model, targets, device)
    # one scratch for every strided slice: a buffer allocated and freed per tensor fragments the
    # heap (glibc serves the next from freed space that parameters then pin), 100-170 MiB here
    scratch = torch.empty(SCRATCH_BYTES, dtype=torch.uint8) if origins else None
    state = {}
    for name in tqdm(list(weights), desc=desc, unit="tensor", disable=None):
        source = weights.pop(name)
        ref = origins.get(name)
        is_file = ref is not None and ref[0]() is source  # as read from the file: read it again
        view = views.get(name)
        if (
            is_file
            and view is not None
            and view.device.type == "cpu"
            and view.dtype == source.dtype
        ):
            ref[1].read(out=view, scratch=scratch)  # pread straight into the fused buffer's slice
        elif view is not None:  # the cast and the device copy in one pass, into the fused buffer
            view.copy_(ref[1].read(scratch=scratch) if is_file else source)
        else:
            if source.is_meta and not is_file:  # a lazy tensor rewritten after sanitize made it
                raise ModelLoadError(f"tensor {name!r}: its bytes were never read (a loader bug)")
            source = ref[1].read(scratch=scratch) if is_file else source
            view = source.to(device=device, dtype=targets[name])
        state[name] = view
        del source, view
        if name in keep_dtype:  # fp8 weights kept as e4m3: no NaN code
            _check_fp8(name, state[name])
        elif check_finite:  # after the cast: an fp32 value past fp16's range is inf now
            weight_checks.check_finite(name, state[name])
        # the temporaries (a cast's source, check_finite's masks) freed between parameters kept:
        # handed back at once, or glibc serves later parameters around them and the heap grows
        return_freed_memory()
    model.load_state_dict(state, strict=True, assign=True)
    del scratch
    return_freed_memory()


def _check_fp8(name: str, weight: torch.Tensor) -> None:
    from models import fp8

    try:
        fp8.check_codes(name, weight)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def _allocate_fused(model: nn.Module, targets: dict, device: torch.device) -> dict:
    """Every fusable module's (layers.Attention / GatedMLP `FUSED`) buffer, allocated empty and
    set on the module; returns checkpoint name -> the parameter (a slice of it) to copy into.
    A module whose parts differ in dtype (a broken fp8 checkpoint) is left to `fuse()`."""
    from models.layers import allocate_fused

    views = {}
    for prefix, module in model.named_modules():
        fused = getattr(type(module), "FUSED", None)
        if fused is None:
            continue
        weight_attr, bias_attr, parts = fused
        linears = [getattr(module, p) for p in parts]
        names = [f"{prefix}.{p}.weight" for p in parts]
        biases = [f"{prefix}.{p}.bias" for p in parts] if linears[0].bias is not None else []
        if any(n not in targets for n in names + biases):
            continue  # check_weights names what is missing
        if len({targets[n] for n in names}) != 1 or len({targets[n] for n in biases}) > 1:
            continue
        bias_dtype = targets[biases[0]] if biases else None
        weight, bias = allocate_fused(linears, device, targets[names[0]], bias_dtype)
        setattr(module, weight_attr, weight)
        setattr(module, bias_attr, bias)
        for lin, name, bias_name in zip(linears, names, biases or [None] * len(names)):
            views[name] = lin.weight
            if bias_name is not None:
                views[bias_name] = lin.bias
    return views
