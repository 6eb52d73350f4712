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
    FENCE_NONE,
    DeviceCapabilities,
    capabilities,
    count,
    mlx_core,
    run_fence,
)

# torch dtypes that cross losslessly (float64 only where the device supports it).
_CROSSING_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
)


def _dtype_names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in _CROSSING_DTYPES)


def _caps_for(device: torch.device, field: str) -> DeviceCapabilities:
    table = capabilities()
    caps = table.get(device.type)
    if caps is not None:
        return caps
    allowed = ", ".join(sorted(table))
    if device.type == "cuda":
        why = "MLX cannot borrow torch CUDA memory ('CUDA import is not supported')"
    elif device.type == "meta":
        why = "meta tensors have no data to cross"
    else:
        why = "MLX has no backend for it on this machine"
    raise ValueError(
        f"{field}={device} cannot cross the MLX bridge: {why}; allowed values: {allowed}"
    )


def _as_device(device: str | torch.device, field: str) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{field}={device!r} is not a torch device ({exc})") from None


def _check_dtype(dtype: torch.dtype, caps: DeviceCapabilities, field: str) -> None:
    if dtype not in _CROSSING_DTYPES:
        raise ValueError(
            f"{field} has dtype {dtype}, which cannot cross the MLX bridge; allowed values: {_dtype_names()}"
        )
    if dtype == torch.float64 and not caps.supports_float64:
        raise ValueError(
            f"{field} has dtype torch.float64, which {caps.torch_device} does not support; "
            "use float32 or keep the tensor on cpu"
        )


def _stream_for(mx, caps: DeviceCapabilities, dtype=None):
    # float64 exists only on MLX's CPU stream, whatever the default device is.
    if dtype is not None and dtype == mx.float64:
        return mx.cpu
    return mx.cpu if caps.mlx_device == "cpu" else mx.gpu


def _import(t: torch.Tensor, caps: DeviceCapabilities, *, owned: bool, field: str):
    """One torch tensor -> MLX array. Returns (array, is_zero_copy). Caller holds the lock."""
    mx = mlx_core()
    _check_dtype(t.dtype, caps, field)
    source = t.detach()
    if caps.import_zero_copy and not owned:
        count(imports=1, zero_copy_imports=1)
        return mx.asarray(source, copy=False), True
    # mx.asarray silently narrows float64 to float32 unless the dtype is forced.
    dtype = mx.float64 if source.dtype == torch.float64 else None
    with mx.stream(_stream_for(mx, caps, dtype)):
        array = mx.asarray(source, dtype=dtype, copy=True)
    count(imports=1, copies=1, bytes_copied=source.numel() * source.element_size())
    return array, False


def _has_negative_stride(array) -> bool:
    # Needs an evaluated array; reading the buffer strides costs well under a microsecond.
    return any(s < 0 for s in memoryview(array).strides)


def _export(array, target: torch.device, caps: DeviceCapabilities) -> torch.Tensor:
    """Evaluated, non-negative-stride MLX array -> torch tensor on `target`."""
    out = torch.from_dlpack(array, device=target)
    if out.device.type != target.type:
        out = out.to(target)
        count(copies=1, bytes_copied=out.numel() * out.element_size(), exports=1)
        return out
    if caps.export_zero_copy:
        count(exports=1, zero_copy_exports=1)
    else:
        count(exports=1, copies=1, bytes_copied=out.numel() * out.element_size())
    return out


def _export_all(arrays: list, target: torch.device, caps: DeviceCapabilities) -> list[torch.Tensor]:
    """ONE eval for every output, one extra pass only for negative-stride outputs, then export."""
    mx = mlx_core()
    for i, array in enumerate(arrays):
        if not isinstance(array, mx.array):
            raise TypeError(f"MLX op output {i} is {type(array).__name__}; expected mlx.core.array")
        if array.dtype == mx.float64 and not caps.supports_float64:
            raise ValueError(
                f"MLX op output {i} is float64, which target device {target} does not support"
            )
    mx.eval(*arrays)
    count(evals=1)
    flipped = [i for i, a in enumerate(arrays) if _has_negative_stride(a)]
    if flipped:
        with mx.stream(_stream_for(mx, caps)):
            fixed = {i: mx.contiguous(arrays[i]) for i in flipped}
        mx.eval(*fixed.values())
        count(evals=1, materializations=len(fixed), copies=len(fixed))
        count(bytes_copied=sum(a.nbytes for a in fixed.values()))
        arrays = [fixed.get(i, a) for i, a in enumerate(arrays)]
    return [_export(a, target, caps) for a in arrays]


class MlxTensorView:
    """A torch tensor and the MLX array borrowed from it, kept alive together.

    Holding the torch tensor too matters: where the import is zero-copy the MLX array reads
    torch's storage, which must not be freed while the view lives. Meant for immutable weights;
    `matches(t)` tells whether `t` is still the tensor this view was built from (a replaced or
    reallocated weight changes its data_ptr, shape, stride, dtype or device).
    """

    __slots__ = ("tensor", "array", "is_zero_copy")

    def __init__(self, tensor: torch.Tensor, array, is_zero_copy: bool):
        self.tensor = tensor  # detached; shares storage with the source
        self.array = array
        self.is_zero_copy = is_zero_copy

    def matches(self, t: torch.Tensor) -> bool:
        """True when `t` is the same storage, layout and type this view was built from."""
        return (
            isinstance(t, torch.Tensor)
            and t.device == self.tensor.device
            and t.dtype == self.tensor.dtype
            and t.shape == self.tensor.shape
            and t.stride() == self.tensor.stride()
            and t.data_ptr() == self.tensor.data_ptr()
        )

    def __repr__(self) -> str:
        t = self.tensor
        mode = "zero-copy" if self.is_zero_copy else "copy"
        return f"MlxTensorView(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}, {mode})"


def _fence_once(devices: list[torch.device]) -> None:
    kinds = {_caps_for(d, "device").fence for d in devices} - {FENCE_NONE}
    for kind in sorted(kinds):  # one kind (mps) exists today: one fence per crossing
        run_fence(kind)
        count(fences=1)


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
            _check_dtype(t.dtype, _caps_for(t.device, f"tensors[{i}].device"), f"tensors[{i}]")
        if synchronize:
            _fence_once([t.device for t in tensors])
        views = []
        for i, t in enumerate(tensors):
            array, zero_copy = _import(
                t, _caps_for(t.device, "device"), owned=False, field=f"tensors[{i}]"
            )
            views.append(MlxTensorView(t.detach(), array, zero_copy))
        return tuple(views)


def torch_to_mlx(t: torch.Tensor):
    """An independent, MLX-owned, evaluated copy of `t` (CPU float64 stays float64)."""
    with BRIDGE_LOCK:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"t is {type(t).__name__}; expected torch.Tensor")
        caps = _caps_for(t.device, "t.device")
        _check_dtype(t.dtype, caps, "t")
        _fence_once([t.device])
        array, _ = _import(t, caps, owned=True, field="t")
        mlx_core().eval(array)
        count(evals=1)
        return array


def mlx_to_torch(array, device: str | torch.device = "cpu") -> torch.Tensor:
    """Evaluate `array` and export it to torch on `device` (zero-copy where the platform allows).

    A CPU target shares MLX's storage. Negative-stride arrays are materialised first.
    """
    with BRIDGE_LOCK:
        target = _as_device(device, "device")
        caps = _caps_for(target, "device")
        return _export_all([array], target, caps)[0]


def _tensor_of(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, MlxTensorView):
        return value.tensor
    return None


def _run(op: Callable, args: tuple, kwargs: dict, device, multi: bool) -> list[torch.Tensor]:
    mx = mlx_core()
    with BRIDGE_LOCK:
        # Every check comes before the fence: bad input costs no device work.
        target = None if device is None else _as_device(device, "device")
        target_caps = None if target is None else _caps_for(target, "device")
        named = [(f"args[{i}]", a) for i, a in enumerate(args)]
        named += [(f"{k}", v) for k, v in kwargs.items()]
        inputs = [(name, _tensor_of(v)) for name, v in named if _tensor_of(v) is not None]
        for name, t in inputs:
            _check_dtype(t.dtype, _caps_for(t.device, f"{name}.device"), name)
        if target is None:  # default: the first tensor's device, cpu when there is none
            target = inputs[0][1].device if inputs else torch.device("cpu")
            target_caps = _caps_for(target, "device")
        _fence_once([t.device for _, t in inputs])
        borrowed: list = []  # kept alive until every output is exported

        def to_mlx(name, value):
            if isinstance(value, MlxTensorView):
                return value.array
            if isinstance(value, torch.Tensor):
                caps = _caps_for(value.device, "device")
                array, _ = _import(value, caps, owned=False, field=name)
                borrowed.append((value, array))
                return array
            return value

        mx_args = [to_mlx(name, a) for name, a in named[: len(args)]]
        mx_kwargs = {k: to_mlx(k, v) for k, v in kwargs.items()}
        with mx.stream(_stream_for(mx, target_caps)):
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
        exported = _export_all(outputs, target, target_caps)
        borrowed.clear()  # inputs may be released only now, after export
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
