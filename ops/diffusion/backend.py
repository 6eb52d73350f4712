"""Resolve the diffusion op bundle a patched module calls, from the ops table.

The table (ops/registry.py) decides torch vs MLX per op once, from TORCH_RUNNER_USE_MLX and
TORCH_RUNNER_MLX_OPS. Patched modules capture the chosen functions themselves, not the
dispatcher, so a forward costs no table lookup; an explicit backend serves side-by-side
benchmarks and embedders that want one backend for the whole pipeline.
"""

from __future__ import annotations

import importlib

from bridge.runtime import ENV_USE_MLX, use_mlx
from ops import registry
from ops.diffusion.modules import DiffusionOps

DIFFUSION_OPS = ("norm_infer", "modulate", "dit_rope")
BACKENDS = ("torch", "mlx")


def _load(path: str):
    module_name, func_name = path.split(":")
    return getattr(importlib.import_module(module_name), func_name)


def resolve_ops(backend: str | None = None) -> DiffusionOps:
    """The three diffusion ops for `backend`: None = the table's choice, or "torch" / "mlx".

    "mlx" needs TORCH_RUNNER_USE_MLX=1 (the one switch that allows importing mlx).
    """
    if backend is None:
        chosen = registry.backends()
        names = {op: chosen[op] for op in DIFFUSION_OPS}
        kinds = set(names.values())
        label = kinds.pop() if len(kinds) == 1 else ", ".join(f"{k}={v}" for k, v in names.items())
    elif backend in BACKENDS:
        if backend == "mlx" and not use_mlx():
            raise ValueError(f"backend='mlx' needs {ENV_USE_MLX}=1 (MLX is off in this process)")
        names = dict.fromkeys(DIFFUSION_OPS, backend)
        label = backend
    else:
        raise ValueError(
            f"backend={backend!r} is not supported; allowed values: None, {', '.join(map(repr, BACKENDS))}"
        )
    impls = {op: _load(registry.OPS[op][BACKENDS.index(kind)]) for op, kind in names.items()}
    return DiffusionOps(backend=label, **impls)
