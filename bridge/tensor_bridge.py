"""Torch <-> MLX tensor crossings with explicit ownership.

Every MLX-substituted op crosses here, so the rules are few and explicit:

- Owned (`torch_to_mlx`): an independent, evaluated MLX copy. Mutating or freeing the torch
  source never changes it.
- Borrowed (`mlx_call`, `mlx_call_multi`): inputs are imported for one call (zero-copy where the
  platform allows, otherwise one counted copy) and kept alive until the outputs are exported.
- Persistent (`MlxTensorView` from `borrow_torch_tensors`): holds BOTH the detached torch tensor
  and the MLX array, so the storage outlives `del source`; `matches()` detects a replaced weight.

One crossing = validate every device first, ONE producer fence (`torch.mps.synchronize()` on
MPS, none for CPU), run the op, ONE `mx.eval` for all outputs, materialise only outputs with
negative strides (torch's DLPack importer aborts the process on them), DLPack export.

Autograd: inputs are detached before they cross; outputs never require grad and have no
`grad_fn`. Gradients do not flow through the bridge.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from bridge.bridge_state import (
    BRIDGE_LOCK,
    COUNTERS,
    DeviceCapabilities,
    capability_table,
    mlx_core,
)
from bridge.crossing import (
    CROSSING_DTYPES,
    as_device,
    caps_for,
    check_dtype,
    export_all,
    fence_once,
    import_tensor,
    stream_for,
)


class MlxTensorView:
    """A torch tensor and the MLX array borrowed from it, kept alive together.

    Holding the torch tensor too matters: where the import is zero-copy the MLX array reads
    torch's storage, which must not be freed while the view lives. Meant for immutable weights;
    `matches(t)` is True only while the MLX array still holds `t`'s current values: the same
    storage, layout and type (a replaced or reallocated weight changes its data_ptr, shape,
    stride, dtype or device) and, where the import copied, no in-place write since (torch's
    version counter, shared by views and `detach()`, counts every in-place op; a tensor that
    has none, an inference tensor, can never be proven unchanged, so a copy of it never matches).
    Writes through `.data` bypass the counter: replace a weight instead (see docs/bridge.md).
    """

    __slots__ = ("tensor", "array", "is_zero_copy", "version")

    def __init__(self, tensor: torch.Tensor, array, is_zero_copy: bool):
        self.tensor = tensor  # detached; shares storage with the source
        self.array = array
        self.is_zero_copy = is_zero_copy
        self.version = _version_of(tensor)

    def matches(self, t: torch.Tensor) -> bool:
        """True when MLX sees `t`'s current values: same storage, layout, type and, for a copy,
        the same version (no in-place write since the copy was taken)."""
        return (
            isinstance(t, torch.Tensor)
            and t.device == self.tensor.device
            and t.dtype == self.tensor.dtype
            and t.shape == self.tensor.shape
            and t.stride() == self.tensor.stride()
            and t.data_ptr() == self.tensor.data_ptr()
            and (self.is_zero_copy or (self.version is not None and _version_of(t) == self.version))
        )

    def __repr__(self) -> str:
        t = self.tensor
        mode = "zero-copy" if self.is_zero_copy else "copy"
        return f"MlxTensorView(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}, {mode})"


def _version_of(t: torch.Tensor) -> int | None:
    """torch's in-place write counter of `t`, or None for an inference tensor (it has none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def borrow_torch_tensors(
    *tensors: torch.Tensor, synchronize: bool = True
) -> tuple[MlxTensorView, ...]:
    """Borrow torch tensors into MLX as `MlxTensorView`s (zero-copy where supported).

    Every device and dtype is validated before any fence; then ONE producer fence for the whole
    batch (when `synchronize` and any tensor needs one). Views keep their storage alive.
    """
    with BRIDGE_LOCK:
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}] is {type(t).__name__}; expected torch.Tensor")
            check_dtype(t.dtype, caps_for(t.device, f"tensors[{i}].device"), f"tensors[{i}]")
        caps_list = [caps_for(t.device, "device") for t in tensors]
        if synchronize:
            fence_once(caps_list)
        views = []
        for t, caps in zip(tensors, caps_list):
            array, zero_copy = import_tensor(t, caps, owned=False)
            views.append(MlxTensorView(t.detach(), array, zero_copy))
        return tuple(views)


def torch_to_mlx(t: torch.Tensor):
    """An independent, MLX-owned, evaluated copy of `t` (CPU float64 stays float64)."""
    with BRIDGE_LOCK:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"t is {type(t).__name__}; expected torch.Tensor")
        caps = caps_for(t.device, "t.device")
        check_dtype(t.dtype, caps, "t")
        fence_once([caps])
        array, _ = import_tensor(t, caps, owned=True)
        mlx_core().eval(array)
        COUNTERS["evals"] += 1
        return array


def mlx_to_torch(array, device: str | torch.device = "cpu") -> torch.Tensor:
    """Evaluate `array` and export it to torch on `device` (zero-copy where the platform allows).

    A CPU target shares MLX's storage. Negative-stride arrays are materialised first.
    """
    with BRIDGE_LOCK:
        target = as_device(device, "device")
        caps = caps_for(target, "device")
        return export_all([array], target, caps)[0]


def _slot_name(slot: int | str) -> str:
    return f"args[{slot}]" if isinstance(slot, int) else slot


def _checked_caps(t: torch.Tensor, slot: int | str, table: dict) -> DeviceCapabilities:
    caps = table.get(t.device.type)
    if (
        caps is None
        or t.dtype not in CROSSING_DTYPES
        or (t.dtype == torch.float64 and not caps.supports_float64)
    ):  # slow path only builds the error message naming the argument
        name = _slot_name(slot)
        check_dtype(t.dtype, caps_for(t.device, f"{name}.device"), name)
    return caps


def _run(op: Callable, args: tuple, kwargs: dict, device, multi: bool) -> list[torch.Tensor]:
    mx = mlx_core()
    with BRIDGE_LOCK:
        table = capability_table()
        # Every check comes before the fence: bad input costs no device work.
        target = None if device is None else as_device(device, "device")
        target_caps = None if target is None else caps_for(target, "device")
        slots = [*enumerate(args), *kwargs.items()]
        inputs = []  # (slot, tensor or view, caps)
        for slot, value in slots:
            if isinstance(value, torch.Tensor):
                inputs.append((slot, value, _checked_caps(value, slot, table)))
            elif isinstance(value, MlxTensorView):
                inputs.append((slot, value, _checked_caps(value.tensor, slot, table)))
        if target is None:  # default: the first tensor's device, cpu when there is none
            first = inputs[0][1] if inputs else None
            first = first.tensor if isinstance(first, MlxTensorView) else first
            target = first.device if first is not None else torch.device("cpu")
            target_caps = caps_for(target, "device")
        fence_once([caps for _, _, caps in inputs])
        arrays: dict[int | str, Any] = {}  # borrowed: kept alive until every output is exported
        for slot, value, caps in inputs:
            if isinstance(value, MlxTensorView):
                arrays[slot] = value.array
            else:
                arrays[slot] = import_tensor(value, caps, owned=False)[0]
        mx_args = [arrays.get(i, a) for i, a in enumerate(args)]
        mx_kwargs = {k: arrays.get(k, v) for k, v in kwargs.items()}
        with mx.stream(stream_for(mx, target_caps)):
            result = op(*mx_args, **mx_kwargs)
        if multi:
            if not isinstance(result, (tuple, list)) or not result:
                raise TypeError(
                    f"mlx_call_multi op must return a non-empty tuple/list of mlx arrays; got {type(result).__name__}"
                )
            outputs = list(result)
        else:
            if not isinstance(result, mx.array):
                raise TypeError(
                    f"mlx_call op must return an mlx.core.array; got {type(result).__name__}"
                )
            outputs = [result]
        exported = export_all(outputs, target, target_caps)
        arrays.clear()  # borrowed inputs may be released only now, after export
        return exported


def _call_or_decorate(op: Callable, args: tuple, kwargs: dict, device, multi: bool):
    if not callable(op):
        raise TypeError(f"op is {type(op).__name__}; expected a callable over mlx arrays")
    if args or kwargs or device is not None:
        out = _run(op, args, kwargs, device, multi)
        return tuple(out) if multi else out[0]

    @functools.wraps(op)
    def on_torch(*t_args: Any, device: str | torch.device | None = None, **t_kwargs: Any):
        out = _run(op, t_args, t_kwargs, device, multi)
        return tuple(out) if multi else out[0]

    return on_torch


def mlx_call(
    op: Callable, *tensors_or_views: Any, device: str | torch.device | None = None, **kwargs: Any
):
    """Run `op` (a function of mlx arrays returning one mx.array) on torch tensors.

    Torch tensors and `MlxTensorView`s among the arguments are borrowed into MLX; other
    arguments (floats, ints, None) pass through unchanged. The output lands on `device`
    (default: the first tensor's device; cpu when there is none). Called with only `op`, it
    is a decorator: `@mlx_call` turns a function of mlx arrays into a function of torch tensors.
    """
    return _call_or_decorate(op, tensors_or_views, kwargs, device, multi=False)


def mlx_call_multi(
    op: Callable, *tensors_or_views: Any, device: str | torch.device | None = None, **kwargs: Any
):
    """`mlx_call` for ops returning a non-empty tuple/list of mx.arrays: one fence, one eval."""
    return _call_or_decorate(op, tensors_or_views, kwargs, device, multi=True)
