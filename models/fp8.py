"""fp8 checkpoints: which `quantization_config` holds e4m3 weights, their scale tensors, and the
model's linears replaced by `ops.quant.fp8.Fp8Weight` after loading and fusing.

Formats read (every one stores `X.weight` as float8_e4m3fn plus a multiplier `X.weight_scale` or
`X.weight_scale_inv`): HF `quant_method: "fp8"` (fmt e4m3; `weight_block_size` [128, 128] as
DeepSeek / Qwen3-FP8 write), `"fbgemm_fp8"` (per channel), and `"compressed-tensors"` with
`format: "float-quantized"` 8-bit float weights (llm-compressor: per tensor, channel or block).
A static `X.input_scale` is dropped with one warning: activations are scaled per token instead.
Linears without a scale (the lm_head, `ignore` lists) stay dense.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from models.layers import Attention, GatedMLP, to_placeholders
from ops.quant import fp8 as qfp8

logger = logging.getLogger(__name__)

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")  # both multiply: w ~ fp8 * s
INPUT_SCALE_SUFFIX = ".input_scale"
STRATEGIES = ("tensor", "channel", "block")  # compressed-tensors weight strategies read here


@dataclass(frozen=True)
class Fp8Format:
    block: tuple[int, int] | None = None  # (rows, cols) of one scale block; None: tensor/channel


def checkpoint_format(raw: dict) -> Fp8Format | None:
    """The fp8 format config.json declares, None when it declares none; ValueError for an fp8-like
    config this loader cannot read (naming the field and what is allowed)."""
    config = raw.get("quantization_config")
    if not isinstance(config, dict):
        return None
    method = config.get("quant_method")
    if method == "fbgemm_fp8":
        return Fp8Format()
    if method == "fp8":
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt={fmt!r} is not supported; allowed: e4m3")
        return Fp8Format(_block(config.get("weight_block_size"), "weight_block_size"))
    if method != "compressed-tensors":
        return None
    groups = config.get("config_groups") or {}
    weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
    if not weights or not all(w.get("type") == "float" for w in weights):
        return None  # integer compressed-tensors schemes are not fp8
    fmt = config.get("format")
    bad = [w for w in weights if w.get("num_bits") != 8 or w.get("strategy") not in STRATEGIES]
    if fmt != "float-quantized" or bad:
        raise ValueError(
            f"compressed-tensors quantization_config (format={fmt!r}, weights="
            f"{bad[0] if bad else weights[0]}) is not supported; allowed: format "
            f"'float-quantized' with 8-bit float weights, strategy one of {', '.join(STRATEGIES)}"
        )
    blocks = {_block(w.get("block_structure"), "block_structure") for w in weights}
    blocks = {b for b in blocks if b is not None}
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors config_groups mix block structures {sorted(blocks)}")
    return Fp8Format(blocks.pop() if blocks else None)


def _block(value, field: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise ValueError(f"quantization_config.{field}={value!r}: expected two positive ints")
    return tuple(value)


def take_scales(weights: dict[str, torch.Tensor], fmt: Fp8Format) -> dict[str, torch.Tensor]:
    """Pop every scale tensor from `weights`; returns weight name -> scale, each checked (dtype,
    shape, finite). An fp8 weight without a scale, or of another fp8 kind, is an error naming it."""
    scales, dropped = {}, []
    for name in list(weights):
        if name.endswith(INPUT_SCALE_SUFFIX):
            dropped.append(weights.pop(name))
            continue
        for suffix in SCALE_SUFFIXES:
            if name.endswith(suffix):
                scales[name.removesuffix(suffix) + ".weight"] = (name, weights.pop(name))
    if dropped:
        logger.warning(
            "%d static input_scale tensors ignored: fp8 activations are scaled per token",
            len(dropped),
        )
    for name, tensor in weights.items():
        if tensor.dtype in (torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
            raise ValueError(
                f"tensor {name!r} has dtype {tensor.dtype}; fp8 weights must be float8_e4m3fn"
            )
        if tensor.dtype == qfp8.FP8_DTYPE and name not in scales:
            raise ValueError(f"tensor {name!r} is fp8 but the checkpoint has no scale for it")
    checked = {}
    for weight_name, (scale_name, scale) in scales.items():
        weight = weights.get(weight_name)
        if weight is None or weight.dtype != qfp8.FP8_DTYPE or weight.dim() != 2:
            found = "missing" if weight is None else f"{weight.dtype} {tuple(weight.shape)}"
            raise ValueError(
                f"tensor {scale_name!r} scales {weight_name!r}, which is {found}; expected a "
                "2-D float8_e4m3fn weight"
            )
        if not scale.is_floating_point() or not torch.isfinite(scale.float()).all():
            raise ValueError(f"tensor {scale_name!r} must hold finite floating-point scales")
        qfp8.scale_layout(scale_name, weight.shape, scale.shape, fmt.block)  # raises on shape
        # NaN codes: checked on each weight's own copy as it is loaded (check_codes, called by
        # models/materialize.py), so these checks touch no page of the memory-mapped file
        checked[weight_name] = scale
    return checked


def check_codes(name: str, weight: torch.Tensor) -> None:
    """An e4m3 weight without NaN codes (the format has no inf); ValueError naming it."""
    if num_nan := qfp8.count_nan(weight):
        raise ValueError(f"tensor {name!r} has {num_nan} fp8 NaN value(s)")


def dequantize_weights(weights: dict, scales: dict, fmt: Fp8Format) -> None:
    """Replace each fp8 weight by its fp32 dequantisation in place (`quantization=none`)."""
    for name, scale in scales.items():
        w = qfp8.from_checkpoint(name, weights[name], scale, torch.float32, fmt.block)
        weights[name] = w.dequantize()


def apply_checkpoint_fp8(model: nn.Module, scales: dict, fmt: Fp8Format, dtype) -> int:
    """Replace the loaded (fused) fp8 weights by Fp8Weight objects; returns how many."""
    from models.quantize import _replace_buffer, _replace_weight

    used = set()

    def fused(module: nn.Module, name: str, attr: str, parts: tuple[str, ...]) -> None:
        names = [f"{name}.{p}.weight" for p in parts]
        have = [n in scales for n in names]
        if not any(have):
            return
        if not all(have):
            raise ValueError(f"{', '.join(names)}: fp8 checkpoints must quantize all or none")
        weight = getattr(module, attr)
        linears = [getattr(module, p) for p in parts]
        full = [
            qfp8.from_checkpoint(n, lin.weight, scales[n], dtype, fmt.block).scale
            for n, lin in zip(names, linears)
        ]
        if fmt.block is not None and any(lin.weight.shape[0] % fmt.block[0] for lin in linears):
            raise ValueError(f"{', '.join(names)}: rows not a multiple of the block size")
        used.update(names)
        _replace_buffer(module, attr, qfp8.Fp8Weight(weight, torch.cat(full), dtype, fmt.block))
        to_placeholders(*linears)

    def single(linear: nn.Linear, name: str) -> None:
        key = f"{name}.weight"
        if key in scales:
            used.add(key)
            w = qfp8.from_checkpoint(key, linear.weight, scales[key], dtype, fmt.block)
            _replace_weight(linear, w)

    for name, module in list(model.named_modules()):
        if isinstance(module, Attention):
            fused(module, name, "qkv_weight", ("q_proj", "k_proj", "v_proj"))
            single(module.o_proj, f"{name}.o_proj")
        elif isinstance(module, GatedMLP):
            fused(module, name, "gate_up_weight", ("gate_proj", "up_proj"))
            single(module.down_proj, f"{name}.down_proj")
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        single(model.lm_head, "lm_head")
    left = sorted(set(scales) - used)
    if left:
        raise ValueError(f"fp8 weights outside the dense linears are not supported: {left[:4]}")
    return len(used)
