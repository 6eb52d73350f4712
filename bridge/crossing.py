"""The primitives of one Torch <-> MLX crossing: checks, fence, import, eval, export.

`tensor_bridge.py` composes these into the public entry points; every function here expects
the caller to hold `BRIDGE_LOCK`. Split out so each step can be read (and faked in tests) on
its own.
"""

from __future__ import annotations

import torch

from bridge.bridge_state import (
    COUNTERS,
    FENCE_NONE,
    DeviceCapabilities,
    capability_table,
    mlx_core,
    run_fence,
)

CROSSING_DTYPES = (
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


def dtype_names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in CROSSING_DTYPES)


def caps_for(device: torch.device, field: str) -> DeviceCapabilities:
    table = capability_table()
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


def as_device(device: str | torch.device, field: str) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{field}={device!r} is not a torch device ({exc})") from None


def check_dtype(dtype: torch.dtype, caps: DeviceCapabilities, field: str) -> None:
    if dtype not in CROSSING_DTYPES:
        raise ValueError(
            f"{field} has dtype {dtype}, which cannot cross the MLX bridge; allowed values: {dtype_names()}"
        )
    if dtype == torch.float64 and not caps.supports_float64:
        raise ValueError(
            f"{field} has dtype torch.float64, which {caps.torch_device} does not support; "
            "use float32 or keep the tensor on cpu"
        )


def stream_for(mx, caps: DeviceCapabilities, dtype=None):
    # float64 exists only on MLX's CPU stream, whatever the default device is.
    if dtype is not None and dtype == mx.float64:
        return mx.cpu
    return mx.cpu if caps.mlx_device == "cpu" else mx.gpu


def import_tensor(t: torch.Tensor, caps: DeviceCapabilities, *, owned: bool):
    """One checked torch tensor -> MLX array. Returns (array, is_zero_copy)."""
    mx = mlx_core()
    # DLPack ignores torch's lazy conjugate/negative bits: resolve them or MLX reads raw data.
    source = t.detach()
    if source.is_conj() or source.is_neg():
        source = source.resolve_conj().resolve_neg()
    if caps.import_zero_copy and not owned:
        COUNTERS["imports"] += 1
        COUNTERS["zero_copy_imports"] += 1
        return mx.asarray(source, copy=False), True
    # mx.asarray silently narrows float64 to float32 unless the dtype is forced.
    dtype = mx.float64 if source.dtype == torch.float64 else None
    with mx.stream(stream_for(mx, caps, dtype)):
        array = mx.asarray(source, dtype=dtype, copy=True)
    COUNTERS["imports"] += 1
    COUNTERS["copies"] += 1
    COUNTERS["bytes_copied"] += source.numel() * source.element_size()
    return array, False


def has_negative_stride(array) -> bool:
    # Needs an evaluated array; reading the buffer strides costs well under a microsecond.
    return any(s < 0 for s in memoryview(array).strides)


def export_array(array, target: torch.device, caps: DeviceCapabilities) -> torch.Tensor:
    """Evaluated, non-negative-stride MLX array -> torch tensor on `target`."""
    if target.type == "cpu" and caps.mlx_device == "cpu":  # already host memory: no dl_device
        out = torch.from_dlpack(array)
        on_target = out.is_cpu
    else:  # e.g. unified memory: ask DLPack for a view on the target device
        out = torch.from_dlpack(array, device=target)
        on_target = out.device.type == target.type
    if not on_target:
        out = out.to(target)
    COUNTERS["exports"] += 1
    if not on_target or not caps.export_zero_copy:
        COUNTERS["copies"] += 1
        COUNTERS["bytes_copied"] += out.numel() * out.element_size()
    else:
        COUNTERS["zero_copy_exports"] += 1
    return out


def export_all(arrays: list, target: torch.device, caps: DeviceCapabilities) -> list[torch.Tensor]:
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
    COUNTERS["evals"] += 1
    flipped = [i for i, a in enumerate(arrays) if has_negative_stride(a)]
    if flipped:
        with mx.stream(stream_for(mx, caps)):
            fixed = {i: mx.contiguous(arrays[i]) for i in flipped}
        mx.eval(*fixed.values())
        COUNTERS["evals"] += 1
        COUNTERS["materializations"] += len(fixed)
        COUNTERS["copies"] += len(fixed)
        COUNTERS["bytes_copied"] += sum(a.nbytes for a in fixed.values())
        arrays = [fixed.get(i, a) for i, a in enumerate(arrays)]
    return [export_array(a, target, caps) for a in arrays]


def fence_once(caps_list) -> None:
    """ONE producer fence for every input of a crossing (none when all inputs are CPU)."""
    kinds = {caps.fence for caps in caps_list}
    kinds.discard(FENCE_NONE)
    for kind in sorted(kinds):  # one kind (mps) exists today: at most one fence per crossing
        run_fence(kind)
        COUNTERS["fences"] += 1
