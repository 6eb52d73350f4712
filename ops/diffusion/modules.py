"""Ops-backed stand-ins for diffusers' norm and adaLN modules.

Each stand-in keeps the replaced module's parameters and submodules (the same objects, under the
same names), so `state_dict()` keys, `.to()` and weight loading behave exactly as before, and it
remembers the original outside the module tree so `unpatch` can put it back. The op callables are
chosen once, when the stand-in is built, from the backend table; forward never branches on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class DiffusionOps:
    """The op implementations a patched module calls (one backend, chosen at patch time)."""

    backend: str
    norm_infer: Callable[..., torch.Tensor]
    modulate: Callable[..., torch.Tensor]
    dit_rope: Callable[..., torch.Tensor]


class OpsModule(nn.Module):
    """Base of every stand-in: holds the op bundle and the module it replaced."""

    def __init__(self, original: nn.Module, ops: DiffusionOps):
        super().__init__()
        # Not a submodule: the original must not appear in state_dict() or named_modules().
        object.__setattr__(self, "original", original)
        self.ops = ops


class OpsNorm(OpsModule):
    """RMS or layer norm over the last dim through `norm_infer`.

    `eps=None` keeps torch.nn.RMSNorm's meaning: the machine epsilon of the input dtype.
    """

    def __init__(
        self,
        original: nn.Module,
        ops: DiffusionOps,
        *,
        weight: nn.Parameter | None,
        bias: nn.Parameter | None,
        eps: float | None,
        is_rms_norm: bool,
    ):
        super().__init__(original, ops)
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        self.eps = eps
        self.is_rms_norm = is_rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return self.ops.norm_infer(x, self.weight, self.bias, eps, self.is_rms_norm)

    def extra_repr(self) -> str:
        kind = "rms" if self.is_rms_norm else "layer"
        return f"{kind}, eps={self.eps}, backend={self.ops.backend}"


class OpsAdaLayerNormZero(OpsModule):
    """diffusers AdaLayerNormZero: norm(x) * (1 + scale_msa) + shift_msa, plus the other chunks."""

    def __init__(self, original: nn.Module, ops: DiffusionOps, norm: OpsNorm):
        super().__init__(original, ops)
        self.emb = original.emb
        self.silu = original.silu
        self.linear = original.linear
        self.norm = norm

    def forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        if self.emb is not None:
            emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
        emb = self.linear(self.silu(emb))  # [B, 6 * D]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = self.ops.modulate(self.norm(x), shift_msa, scale_msa)  # [B, N, D]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class OpsAdaLayerNormZeroSingle(OpsModule):
    """diffusers AdaLayerNormZeroSingle (Flux single-stream blocks): three chunks."""

    def __init__(self, original: nn.Module, ops: DiffusionOps, norm: OpsNorm):
        super().__init__(original, ops)
        self.silu = original.silu
        self.linear = original.linear
        self.norm = norm

    def forward(self, x, emb=None):
        emb = self.linear(self.silu(emb))  # [B, 3 * D]
        shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
        return self.ops.modulate(self.norm(x), shift_msa, scale_msa), gate_msa


class OpsAdaLayerNormContinuous(OpsModule):
    """diffusers AdaLayerNormContinuous (final norm of Flux/SD3): chunks are (scale, shift)."""

    def __init__(self, original: nn.Module, ops: DiffusionOps, norm: OpsNorm):
        super().__init__(original, ops)
        self.silu = original.silu
        self.linear = original.linear
        self.norm = norm

    def forward(self, x, conditioning_embedding):
        emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))  # [B, 2 * D]
        scale, shift = torch.chunk(emb, 2, dim=1)
        return self.ops.modulate(self.norm(x), shift, scale)


class OpsSanaModulatedNorm(OpsModule):
    """diffusers SanaModulatedNorm (final norm of Sana): shift/scale from a table plus temb."""

    def __init__(self, original: nn.Module, ops: DiffusionOps, norm: OpsNorm):
        super().__init__(original, ops)
        self.norm = norm

    def forward(self, hidden_states, temb, scale_shift_table):
        table = scale_shift_table[None] + temb[:, None].to(scale_shift_table.device)  # [B, 2, D]
        shift, scale = table.chunk(2, dim=1)  # [B, 1, D] each
        return self.ops.modulate(self.norm(hidden_states), shift, scale)
