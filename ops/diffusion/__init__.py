"""Diffusion ops for pipelines that embed torch_runner's op layer without its runner.

`norm_infer`, `modulate` and `dit_rope` are the torch references (MLX variants with the same
signatures live in ops.diffusion.mlx and are picked by the ops table under the usual
TORCH_RUNNER_USE_MLX / TORCH_RUNNER_MLX_OPS toggles; `ops.norm_infer(...)` dispatches). `patch`
swaps a diffusers transformer's norm and adaLN modules for ops-backed ones; `unpatch` undoes it.
Nothing here imports diffusers or mlx.
"""

from ops.diffusion.backend import resolve_ops
from ops.diffusion.modulation import modulate
from ops.diffusion.modules import DiffusionOps
from ops.diffusion.norm import norm_infer
from ops.diffusion.patch import PatchEntry, PatchReport, patch, unpatch
from ops.diffusion.rotary import dit_rope

__all__ = [
    "DiffusionOps",
    "PatchEntry",
    "PatchReport",
    "dit_rope",
    "modulate",
    "norm_infer",
    "patch",
    "resolve_ops",
    "unpatch",
]
