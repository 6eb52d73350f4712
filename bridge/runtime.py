"""The MLX runtime gate.

`use_mlx()` is the one switch for every MLX path. When `TORCH_RUNNER_USE_MLX` is off, nothing
here (or anywhere in the four packages) imports mlx. When it is on, the runtime is validated
before anything else happens -- before a model path is resolved or a weight is read -- so a
wrong install fails in one clear message instead of at a random op later.

Version policy (copied from the SGLang bridge it descends from): torch must be a *stable* 2.13.x
(the DLPack and MPS semantics the bridge relies on changed in 2.13 and are unverified in 2.14);
MLX only has a floor (stable >= 0.32.0, later stable minors accepted).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
from packaging.version import InvalidVersion, Version

ENV_USE_MLX = "TORCH_RUNNER_USE_MLX"
MIN_MLX_VERSION = Version("0.32.0")
SUPPORTED_TORCH_SERIES = (2, 13)
FIX_HINT = "install the mlx extra: pip install -e '.[mlx]' (torch==2.13.0, mlx>=0.32.0)"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class MlxRuntimeError(RuntimeError):
    """MLX was requested but the runtime cannot honour it."""


def parse_flag(name: str, raw: str | None) -> bool:
    """Parse a boolean environment flag, rejecting anything ambiguous."""
    value = (raw or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{name}={raw!r} is not a boolean; allowed values: {', '.join(_TRUE + _FALSE[1:])}"
    )


def is_stable_series(raw_version: object, series: tuple[int, int]) -> bool:
    """True for a stable release of exactly `series` (rc, dev and other minors rejected)."""
    try:
        version = Version(str(raw_version).split("+")[0])
    except InvalidVersion:
        return False
    return not (version.is_prerelease or version.is_devrelease) and version.release[:2] == series


def is_stable_at_least(raw_version: object, minimum: Version) -> bool:
    """True for a stable release >= `minimum` (rc and dev builds rejected)."""
    try:
        version = Version(str(raw_version).split("+")[0])
    except InvalidVersion:
        return False
    return not (version.is_prerelease or version.is_devrelease) and version >= minimum


def _import_mlx():
    try:
        import mlx.core as mx
    except ImportError as exc:
        raise MlxRuntimeError(
            f"{ENV_USE_MLX}=1 requires MLX, but `import mlx.core` failed ({exc}); {FIX_HINT}"
        ) from None
    return mx


@lru_cache(maxsize=1)
def validate_runtime() -> None:
    """Check that mlx imports and that torch and MLX versions are supported."""
    mx = _import_mlx()
    torch_version = getattr(torch, "__version__", None)
    mlx_version = getattr(mx, "__version__", None)
    if not is_stable_series(torch_version, SUPPORTED_TORCH_SERIES):
        raise MlxRuntimeError(
            f"{ENV_USE_MLX}=1 requires a stable torch 2.13.x; found torch {torch_version or 'unknown'}; "
            f"{FIX_HINT}"
        )
    if not is_stable_at_least(mlx_version, MIN_MLX_VERSION):
        raise MlxRuntimeError(
            f"{ENV_USE_MLX}=1 requires a stable MLX >= {MIN_MLX_VERSION}; found MLX "
            f"{mlx_version or 'unknown'}; {FIX_HINT}"
        )


def validate_device(device: torch.device) -> None:
    """Check that MLX can work with tensors on the torch `device` in use.

    MPS pairs with MLX's Metal device (shared unified memory); torch CPU pairs with MLX's CPU
    stream; torch CUDA memory cannot be borrowed by MLX at all.
    """
    mx = _import_mlx()
    if device.type == "mps":
        metal = getattr(mx, "metal", None)
        is_available = getattr(metal, "is_available", None)
        if not callable(is_available) or not is_available():
            raise MlxRuntimeError(
                f"{ENV_USE_MLX}=1 with device mps requires MLX's Metal device, but "
                f"mx.metal.is_available() is False (MLX {mx.__version__}); {FIX_HINT}"
            )
    elif device.type == "cuda":
        raise MlxRuntimeError(
            f"{ENV_USE_MLX}=1 cannot run with device {device}: MLX cannot borrow torch CUDA "
            "memory ('CUDA import is not supported'). Run on CUDA without MLX (unset "
            f"{ENV_USE_MLX}), or keep MLX and pass --device cpu (or mps on Apple silicon)."
        )
    elif device.type != "cpu":
        raise MlxRuntimeError(
            f"{ENV_USE_MLX}=1 supports devices mps and cpu; found {device}. Unset {ENV_USE_MLX} "
            "to run this device with torch only."
        )


@lru_cache(maxsize=1)
def use_mlx() -> bool:
    """Whether MLX substitution is on. Validates the runtime the first time it says yes."""
    enabled = parse_flag(ENV_USE_MLX, os.environ.get(ENV_USE_MLX))
    if enabled:
        validate_runtime()
    return enabled


def reset_cache() -> None:
    """Forget cached answers (tests change the environment between cases)."""
    use_mlx.cache_clear()
    validate_runtime.cache_clear()
