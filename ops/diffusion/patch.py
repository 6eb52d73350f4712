"""patch / unpatch: swap a diffusers transformer's norm and adaLN modules for ops-backed ones.

Why swap modules rather than classes: patching `diffusers.models.normalization.RMSNorm.forward`
would change every model in the process and survive the caller; swapping instances in one module
tree is local, reversible (`unpatch`) and visible (`PatchReport`). Classes are matched by their
qualified name, so importing ops never imports diffusers. Anything that does not map one-to-one
onto norm_infer / modulate is left alone, and the report says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ops.diffusion.backend import resolve_ops
from ops.diffusion.modules import (
    DiffusionOps,
    OpsAdaLayerNormContinuous,
    OpsAdaLayerNormZero,
    OpsAdaLayerNormZeroSingle,
    OpsModule,
    OpsNorm,
    OpsSanaModulatedNorm,
)

_NORMALIZATION = "diffusers.models.normalization"
_SANA = "diffusers.models.transformers.sana_transformer"


class Unmappable(Exception):
    """A module that looks swappable but does not map cleanly; the message is the reason."""


@dataclass(frozen=True)
class PatchEntry:
    """One module the walk looked at: its dotted name, its class, and what happened to it."""

    name: str
    kind: str
    detail: str


@dataclass
class PatchReport:
    """What `patch` replaced (detail: the stand-in class) and left alone (detail: why)."""

    backend: str
    replaced: list[PatchEntry] = field(default_factory=list)
    left_alone: list[PatchEntry] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"backend: {self.backend}; replaced {len(self.replaced)}, left alone {len(self.left_alone)}"
        ]
        lines += [f"  replaced   {e.name} ({e.kind}) -> {e.detail}" for e in self.replaced]
        lines += [f"  left alone {e.name} ({e.kind}): {e.detail}" for e in self.left_alone]
        return "\n".join(lines)


def _kind(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _last_dim_only(shape, kind: str) -> None:
    if len(tuple(shape)) != 1:
        raise Unmappable(
            f"{kind} normalises over {len(tuple(shape))} trailing dims; norm_infer covers the last dim only"
        )


def _layer_norm(module: nn.Module, ops: DiffusionOps) -> OpsNorm:
    _last_dim_only(module.normalized_shape, "LayerNorm")
    return OpsNorm(
        module, ops, weight=module.weight, bias=module.bias, eps=module.eps, is_rms_norm=False
    )


def _torch_rms_norm(module: nn.Module, ops: DiffusionOps) -> OpsNorm:
    _last_dim_only(module.normalized_shape, "RMSNorm")
    return OpsNorm(module, ops, weight=module.weight, bias=None, eps=module.eps, is_rms_norm=True)


def _diffusers_rms_norm(module: nn.Module, ops: DiffusionOps) -> OpsNorm:
    _last_dim_only(module.dim, "RMSNorm")
    bias = getattr(module, "bias", None)
    return OpsNorm(module, ops, weight=module.weight, bias=bias, eps=module.eps, is_rms_norm=True)


def _inner_norm(module: nn.Module, ops: DiffusionOps) -> OpsNorm:
    builder = _NORMS.get(_kind(module.norm))
    if builder is None:
        raise Unmappable(f"its inner norm {_kind(module.norm)} has no ops-backed equivalent")
    return builder(module.norm, ops)


def _wrapper(cls: type[OpsModule]) -> Callable[[nn.Module, DiffusionOps], OpsModule]:
    return lambda module, ops: cls(module, ops, _inner_norm(module, ops))


_NORMS: dict[str, Callable[[nn.Module, DiffusionOps], OpsNorm]] = {
    _kind(nn.LayerNorm(1)): _layer_norm,
    f"{_NORMALIZATION}.FP32LayerNorm": _layer_norm,  # fp32 math, input dtype out: norm_infer's contract
    f"{_NORMALIZATION}.LayerNorm": _layer_norm,
    _kind(nn.RMSNorm(1)): _torch_rms_norm,
    f"{_NORMALIZATION}.RMSNorm": _diffusers_rms_norm,
    f"{_NORMALIZATION}.MochiRMSNorm": _diffusers_rms_norm,
}
_MODULATED: dict[str, Callable[[nn.Module, DiffusionOps], OpsModule]] = {
    f"{_NORMALIZATION}.AdaLayerNormZero": _wrapper(OpsAdaLayerNormZero),
    f"{_NORMALIZATION}.AdaLayerNormZeroSingle": _wrapper(OpsAdaLayerNormZeroSingle),
    f"{_NORMALIZATION}.AdaLayerNormContinuous": _wrapper(OpsAdaLayerNormContinuous),
    f"{_SANA}.SanaModulatedNorm": _wrapper(OpsSanaModulatedNorm),
}
_INLINE_MODULATION = "applies scale/shift inline in forward (no module boundary to swap); its norm modules are swapped"
_KNOWN_LEFT_ALONE = {
    f"{_NORMALIZATION}.AdaLayerNormSingle": "only computes modulation parameters (no normalisation); blocks apply them inline",
    f"{_NORMALIZATION}.AdaLayerNorm": "chunks one unbatched conditioning vector along dim 0; its inner norm is swapped",
    "diffusers.models.transformers.transformer_flux.FluxTransformerBlock": _INLINE_MODULATION,
    f"{_SANA}.SanaTransformerBlock": _INLINE_MODULATION,
    "diffusers.models.attention.BasicTransformerBlock": _INLINE_MODULATION,
    _kind(
        nn.GroupNorm(1, 1)
    ): "normalises channel groups of [B, C, H, W]; norm_infer is a last-dim norm",
}


def _visit(parent: nn.Module, prefix: str, ops: DiffusionOps, report: PatchReport) -> None:
    for child_name, child in list(parent.named_children()):
        name = f"{prefix}{child_name}"
        kind = _kind(child)
        if isinstance(child, OpsModule):
            report.left_alone.append(PatchEntry(name, kind, "already patched"))
            continue
        builder = _MODULATED.get(kind) or _NORMS.get(kind)
        if builder is not None:
            try:
                replacement = builder(child, ops)
            except Unmappable as exc:
                report.left_alone.append(PatchEntry(name, kind, str(exc)))
            else:
                setattr(parent, child_name, replacement)
                report.replaced.append(PatchEntry(name, kind, type(replacement).__name__))
                continue
        elif kind in _KNOWN_LEFT_ALONE:
            report.left_alone.append(PatchEntry(name, kind, _KNOWN_LEFT_ALONE[kind]))
        elif "Norm" in type(child).__name__:
            report.left_alone.append(
                PatchEntry(name, kind, "no ops-backed equivalent for this class")
            )
        _visit(child, f"{name}.", ops, report)


def patch(module: nn.Module, backend: str | None = None) -> PatchReport:
    """Swap `module`'s norm and adaLN submodules for ops-backed stand-ins, in place.

    backend: None takes the ops table's choice (TORCH_RUNNER_USE_MLX / TORCH_RUNNER_MLX_OPS);
    "torch" or "mlx" picks one explicitly. Already-patched submodules are left as they are, so
    patching twice is harmless. Returns a PatchReport; `unpatch(module)` undoes it.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"patch: module must be a torch.nn.Module (e.g. pipe.transformer); got {type(module).__name__}"
        )
    ops = resolve_ops(backend)
    report = PatchReport(backend=ops.backend)
    if _kind(module) in _NORMS or _kind(module) in _MODULATED:
        reason = "the root module cannot be swapped in place; patch its parent"
        report.left_alone.append(PatchEntry("", _kind(module), reason))
    _visit(module, "", ops, report)
    return report


def unpatch(module: nn.Module) -> list[str]:
    """Put back every module `patch` replaced under `module`; returns their dotted names."""
    restored: list[str] = []

    def restore(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent.named_children()):
            if isinstance(child, OpsModule):
                setattr(parent, child_name, child.original)
                restored.append(f"{prefix}{child_name}")
            else:
                restore(child, f"{prefix}{child_name}.")

    restore(module, "")
    return restored
