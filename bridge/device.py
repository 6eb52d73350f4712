"""Device resolution, in one place: `auto` = mps > cuda > cpu."""

from __future__ import annotations

import torch

ALLOWED_DEVICES = ("auto", "mps", "cuda", "cpu")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """Turn a user's device string into an available `torch.device`.

    `auto` picks mps, then cuda, then cpu. An explicit device that is not available here is an
    error naming it, never a silent fallback to another device.
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    name = str(spec).strip().lower()
    kind = name.split(":", 1)[0]
    if kind not in ALLOWED_DEVICES:
        raise ValueError(
            f"device={spec!r} is not supported; allowed values: {', '.join(ALLOWED_DEVICES)} (cuda:N too)"
        )
    if kind == "auto":
        if _mps_available():
            return torch.device("mps")
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if kind == "mps" and not _mps_available():
        raise ValueError(
            f"device={spec!r} requested but MPS is not available on this machine; use 'auto' or 'cpu'"
        )
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={spec!r} requested but CUDA is not available on this machine; use 'auto' or 'cpu'"
            )
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={spec!r}: only {torch.cuda.device_count()} CUDA device(s) present"
            )
        return device
    return torch.device(name)
