"""Fused CUDA decode kernels (Triton): add+rms_norm, rope+paged KV write, SiLU-mul, clamped SwiGLU.
Owns only kernels and their launchers; imports no models, torch_runner, ops.registry or ops.mlx."""

from __future__ import annotations

import importlib
import os

ENV_FUSED = "TORCH_RUNNER_FUSED_KERNELS"  # "0" keeps CUDA on the torch reference ops
_KERNELS: list = []


def cuda_kernels():
    """ops.fused.triton_kernels when enabled and Triton imports (loaded once), else None."""
    if not _KERNELS:
        module = None
        if os.environ.get(ENV_FUSED, "1") != "0":
            try:
                module = importlib.import_module("ops.fused.triton_kernels")
            except ImportError:  # no Triton: the torch references compute the same function
                module = None
        _KERNELS.append(module)
    return _KERNELS[0]


def kernels_for(x) -> object | None:
    """The Triton kernels for tensor x (CUDA only), or None for the torch reference."""
    return cuda_kernels() if x.is_cuda else None
