"""Shared state of the Torch <-> MLX bridge: the lock, the lazy mlx import, counters, capabilities.

Kept apart from `tensor_bridge.py` so the crossing logic reads top to bottom and so tests can
fake one thing (a capability table, a fence) without reaching into the crossing code.

The capability table is per torch device type. It is *probed* on the CPU (one tiny import and
one tiny export, the first time it is needed) rather than written down per OS, because whether
MLX can wrap torch CPU memory without a copy is a property of the MLX build, not of the OS
name. The MPS entry follows MLX 0.32 + torch 2.13 (zero-copy both ways over unified memory,
fence = `torch.mps.synchronize()`, no float64); it only exists where both MPS and MLX Metal are
available.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch

BRIDGE_LOCK = threading.RLock()
"""Serialises every bridge entry point (one crossing at a time, process-wide).

Covers, for one crossing: the producer fence (`torch.mps.synchronize()`), the DLPack import of
torch storage into MLX, running the MLX op, the single `mx.eval`, negative-stride
materialisation and the DLPack export back to torch. Re-entrant, so an op run by `mlx_call`
may itself call the bridge.

Cannot cover: callers that mutate or free the same torch tensors from other threads or
streams outside the bridge (torch kernels queued after the fence, in-place writes to a weight
that an `MlxTensorView` borrowed). Those races belong to the caller: borrowed tensors must not
be written while a crossing that reads them is in flight.
"""

_mx_module = None


def mlx_core():
    """`mlx.core`, imported on first use so `import bridge` never pulls mlx in."""
    global _mx_module
    if _mx_module is None:
        import mlx.core as mx

        _mx_module = mx
    return _mx_module


@dataclass(frozen=True)
class BridgeStats:
    """Counters of bridge work since the last `reset_stats()` (a snapshot; safe to keep)."""

    fences: int = 0  # producer fences issued (torch.mps.synchronize)
    evals: int = 0  # mx.eval calls made by the bridge
    imports: int = 0  # torch tensors brought into MLX
    zero_copy_imports: int = 0
    exports: int = 0  # MLX arrays handed to torch
    zero_copy_exports: int = 0
    materializations: int = 0  # extra copies for negative-stride outputs
    copies: int = 0  # every payload copy (copying imports, copying exports, materialisations)
    bytes_copied: int = 0


COUNTERS: dict[str, int] = {f.name: 0 for f in dataclasses.fields(BridgeStats)}
"""Live counters. Crossing code adds to them directly while holding BRIDGE_LOCK (a dict
increment is ~20x cheaper than a keyword-argument call, and a crossing makes several)."""


def stats() -> BridgeStats:
    """A snapshot of the bridge counters: fences, evals, imports/exports, copies, bytes copied."""
    with BRIDGE_LOCK:
        return BridgeStats(**COUNTERS)


def reset_stats() -> None:
    """Zero the bridge counters (benchmarks and tests measure one crossing at a time)."""
    with BRIDGE_LOCK:
        for name in COUNTERS:
            COUNTERS[name] = 0


@dataclass(frozen=True)
class DeviceCapabilities:
    """What a crossing costs for torch tensors on one device type."""

    torch_device: str  # "cpu" | "mps"
    mlx_device: str  # MLX device the op runs on: "cpu" | "gpu"
    import_zero_copy: bool  # torch -> MLX shares storage (else one counted copy)
    export_zero_copy: bool  # MLX -> torch shares storage through DLPack
    fence: str  # "none" | "torch.mps.synchronize"
    supports_float64: bool


FENCE_NONE = "none"
FENCE_MPS = "torch.mps.synchronize"

_capability_table: dict[str, DeviceCapabilities] | None = None


def _probe_cpu(mx) -> DeviceCapabilities:
    probe = torch.zeros(4, dtype=torch.float32)
    try:
        mx.asarray(probe, copy=False)
        import_zero_copy = True
    except ValueError:  # "Cannot import a CPU array without a copy" (Linux mlx[cpu])
        import_zero_copy = False
    array = mx.zeros((4,), dtype=mx.float32)
    mx.eval(array)
    exported = torch.from_dlpack(array)
    exported[0] = 1.0  # a write through torch is visible to MLX only if storage is shared
    export_zero_copy = array.tolist()[0] == 1.0
    return DeviceCapabilities("cpu", "cpu", import_zero_copy, export_zero_copy, FENCE_NONE, True)


def _mps_usable(mx) -> bool:
    backend = getattr(torch.backends, "mps", None)
    metal = getattr(mx, "metal", None)
    return bool(
        backend is not None
        and backend.is_available()
        and metal is not None
        and metal.is_available()
    )


def capability_table() -> dict[str, DeviceCapabilities]:
    """The live table (no copy): probed once, then a plain dict read on every crossing."""
    global _capability_table
    table = _capability_table
    if table is not None:
        return table
    with BRIDGE_LOCK:
        if _capability_table is None:
            mx = mlx_core()
            probed = {"cpu": _probe_cpu(mx)}
            if _mps_usable(mx):
                probed["mps"] = DeviceCapabilities("mps", "gpu", True, True, FENCE_MPS, False)
            _capability_table = probed
        return _capability_table


def capabilities() -> dict[str, DeviceCapabilities]:
    """Per torch device type usable with MLX here: zero-copy import/export, fence, float64.

    `cpu` is always present; `mps` only where torch MPS and MLX Metal are both available.
    Any other device (cuda, meta, xpu) cannot cross the bridge.
    """
    return dict(capability_table())


def set_capabilities(table: dict[str, DeviceCapabilities] | None) -> None:
    """Replace the capability table (tests fake an MPS platform); None re-probes on next use."""
    global _capability_table
    with BRIDGE_LOCK:
        _capability_table = dict(table) if table is not None else None


def run_fence(kind: str) -> None:
    """Issue one producer fence of `kind` so MLX reads what torch has finished writing."""
    if kind == FENCE_MPS:
        torch.mps.synchronize()
    elif kind != FENCE_NONE:
        raise ValueError(f"fence={kind!r} is unknown; allowed values: {FENCE_NONE}, {FENCE_MPS}")
