"""The one table of swappable ops, and the start-up choice of backend per op.

Why a table chosen once: a per-call `if use_mlx()` would hide the routing inside every op and
re-decide it on the hot path. Instead `configure()` reads the environment once, picks torch or
MLX per op, logs the result once, and `ops.<name>(...)` calls the chosen function through one
dict lookup. Implementations are imported on first call, so `import ops` never imports mlx and
an op whose module is missing only fails when someone calls it.

Environment:
- TORCH_RUNNER_USE_MLX=1 routes DEFAULT_MLX_OPS through MLX.
- TORCH_RUNNER_MLX_OPS (only with TORCH_RUNNER_USE_MLX=1) replaces that set: a comma list of
  op names, `all`, `none`, or `auto` (= AUTO_MLX_OPS, the ops measured faster on MLX here).
"""

from __future__ import annotations

import importlib
import logging
import os
import platform
from collections.abc import Callable

from bridge.runtime import ENV_USE_MLX, use_mlx

ENV_MLX_OPS = "TORCH_RUNNER_MLX_OPS"
logger = logging.getLogger("ops")

# op name -> (torch implementation, MLX implementation), as "module:function".
OPS: dict[str, tuple[str, str]] = {
    "attention": ("ops.attention:attention", "ops.mlx.attention:attention"),
    "rms_norm": ("ops.norm:rms_norm", "ops.mlx.norm:rms_norm"),
    # x + residual then the chosen rms_norm (one Triton kernel on CUDA); MLX: the same
    # composition, whose norm is the MLX rms_norm when that op is routed
    "add_rms_norm": ("ops.norm:add_rms_norm", "ops.norm:add_rms_norm"),
    "layer_norm": ("ops.norm:layer_norm", "ops.mlx.norm:layer_norm"),
    "apply_rope": ("ops.rope:apply_rope", "ops.mlx.rope:apply_rope"),
    "moe_gpt_oss": ("ops.moe:moe_gpt_oss", "ops.mlx.moe:moe_gpt_oss"),
    "moe_qwen3": ("ops.moe:moe_qwen3", "ops.mlx.moe:moe_qwen3"),
    "sampler": ("ops.sampling.sampler:sample", "ops.mlx.sampling:sample"),
    # diffusion ops: paths owned by the diffusion engineer (ops/diffusion/)
    "norm_infer": ("ops.diffusion.norm:norm_infer", "ops.diffusion.mlx:norm_infer"),
    "modulate": ("ops.diffusion.modulation:modulate", "ops.diffusion.mlx:modulate"),
    "dit_rope": ("ops.diffusion.rotary:dit_rope", "ops.diffusion.mlx:dit_rope"),
}

# Public attribute on the `ops` package for each op (ops.sample dispatches "sampler").
PUBLIC_NAMES: dict[str, str] = {name: name for name in OPS} | {"sampler": "sample"}

DEFAULT_MLX_OPS = frozenset({"attention", "rms_norm", "sampler"})

# `auto`: ops tools/bench_ops.py measured faster through MLX than torch, per platform
# (docs/perf_sections/ops.md holds the table). Linux x86_64 CPU: none (mlx[cpu] uses a
# single-threaded reference BLAS and every crossing copies).
AUTO_MLX_OPS: dict[str, frozenset[str]] = {
    "Linux-x86_64": frozenset(),
    "Linux-aarch64": frozenset(),
    "Darwin-arm64": frozenset(DEFAULT_MLX_OPS),  # unmeasured here: keep the design's set
}

_IMPLS: dict[str, Callable] = {}
_BACKENDS: dict[str, str] = {}


def parse_mlx_ops(raw: str | None) -> frozenset[str] | None:
    """TORCH_RUNNER_MLX_OPS -> set of op names, or None when unset (use the default set)."""
    value = (raw or "").strip().lower()
    if not value:
        return None
    if value == "all":
        return frozenset(OPS)
    if value == "none":
        return frozenset()
    if value == "auto":
        key = f"{platform.system()}-{platform.machine()}"
        return AUTO_MLX_OPS.get(key, frozenset())
    names = frozenset(part.strip() for part in value.split(",") if part.strip())
    unknown = sorted(names - set(OPS))
    if unknown:
        raise ValueError(
            f"{ENV_MLX_OPS}={raw!r}: unknown op(s) {', '.join(unknown)}; valid names: "
            f"{', '.join(OPS)} (or all, none, auto)"
        )
    return names


def load(path: str) -> Callable:
    """Import "module:function" and return the function."""
    module_name, func_name = path.split(":")
    return getattr(importlib.import_module(module_name), func_name)


def _lazy(name: str, path: str) -> Callable:
    def resolve_and_call(*args, **kwargs):
        impl = _IMPLS[name] = load(path)
        return impl(*args, **kwargs)

    return resolve_and_call


def configure(mlx_ops: str | None = None) -> dict[str, str]:
    """Choose every op's backend now (call again to re-read the environment) and log it once.

    `mlx_ops` overrides TORCH_RUNNER_MLX_OPS (same syntax). Returns `backends()`.
    """
    raw = os.environ.get(ENV_MLX_OPS) if mlx_ops is None else mlx_ops
    chosen = parse_mlx_ops(raw)  # validates names even when MLX is off
    if use_mlx():
        mlx_set = DEFAULT_MLX_OPS if chosen is None else chosen
    else:
        mlx_set = frozenset()
        if chosen:
            logger.warning("%s=%r ignored: %s is off", ENV_MLX_OPS, raw, ENV_USE_MLX)
    _IMPLS.clear()
    _BACKENDS.clear()
    for name, (torch_path, mlx_path) in OPS.items():
        is_mlx = name in mlx_set
        _BACKENDS[name] = "mlx" if is_mlx else "torch"
        _IMPLS[name] = _lazy(name, mlx_path if is_mlx else torch_path)
    logger.info("ops backends: %s", ", ".join(f"{k}={v}" for k, v in _BACKENDS.items()))
    return dict(_BACKENDS)


def backends() -> dict[str, str]:
    """Op name -> "torch" | "mlx", configuring on first use."""
    if not _BACKENDS:
        configure()
    return dict(_BACKENDS)


def impl(name: str) -> Callable:
    """The chosen implementation of op `name` (configures on first use)."""
    if not _IMPLS:
        configure()
    try:
        return _IMPLS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; valid names: {', '.join(OPS)}") from None


def make_dispatcher(name: str) -> Callable:
    """A module-level function `ops.<public name>` that calls the chosen backend of `name`."""
    torch_path = OPS[name][0]

    def dispatch(*args, **kwargs):
        try:
            return _IMPLS[name](*args, **kwargs)
        except KeyError:
            if _IMPLS:
                raise
            configure()
            return _IMPLS[name](*args, **kwargs)

    dispatch.__name__ = dispatch.__qualname__ = PUBLIC_NAMES[name]
    dispatch.__doc__ = (
        f"Op {name!r}: calls the backend chosen at start-up (reference: {torch_path})."
    )
    return dispatch
