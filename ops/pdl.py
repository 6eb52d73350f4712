"""Programmatic dependent launch (PDL, CUDA sm_90+) for the decode step's Triton kernels: the
switch and the launch arguments. No triton import (the kernels' side is ops/pdl_triton.py).

Why: a decode step is a chain of short kernels (a Llama-8B layer: norm, qkv GEMV, rope + KV
write, attention, o GEMV, norm, gate_up GEMV, SiLU-mul, down GEMV), and every boundary drains
the GPU, then ramps the next kernel up from nothing. With PDL a kernel's programs start while
the previous kernel's last ones still run: each kernel signals its dependents as it starts
(`griddepcontrol.launch_dependents`), and waits (`griddepcontrol.wait`: the previous grid
finished and its writes visible) before it reads or writes anything the chain shares; the
GEMVs first ask L2 for the start of their weight rows, which no kernel writes. A kernel that
waits before touching shared memory keeps the chain's order transitively; kernels launched
without PDL (torch's) wait for the previous kernel to finish as always. CUDA graphs keep the
programmatic edges (stream capture records them).
"""

from __future__ import annotations

import os

import torch

from ops.env import env_choice

ENV_PDL = "TORCH_RUNNER_PDL"  # auto (default): on where the GPU has it (sm_90+) | on | off
PDL_MODES = ("auto", "on", "off")
_capable: dict[int, bool] = {}


def pdl_mode() -> str:
    return env_choice(ENV_PDL, "auto", PDL_MODES)


def pdl_on(device: torch.device) -> bool:
    """Whether Triton kernels on `device` launch with PDL: CUDA sm_90+ (Hopper and later), not
    under Triton's CPU interpreter, and not switched off."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if pdl_mode() == "off":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index) >= (9, 0) and _triton_has_gdc()
    return _capable[index]


def _triton_has_gdc() -> bool:
    """Whether the installed Triton has the grid-dependency calls (3.3+; older ones: no PDL)."""
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


def launch_args(device: torch.device) -> dict:
    """Keyword arguments for a PDL-aware Triton kernel's launch: its PDL constexpr, and
    Triton's launch_pdl when on."""
    return {"PDL": True, "launch_pdl": True} if pdl_on(device) else {"PDL": False}
