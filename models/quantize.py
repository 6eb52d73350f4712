"""`--quantization int8 | int4`: replace every dense decoder linear (and the lm_head) by a
weight-only quantized weight (ops/quant/int_linear.py), once, after loading and fusing.

What is replaced: the fused q/k/v and gate/up matrices, o_proj, down_proj and the lm_head (a
tied model gets a quantized copy of the embedding as its head; the lookup table stays dense).
The per-projection q/k/v and gate/up parameters, views of the fused matrices, become `meta`
placeholders, so the dense matrices are freed; the state dict keeps every name and shape but is
no longer a checkpoint (as with oneDNN packing). MoE experts and embeddings are not touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys

import torch
from torch import nn

from models.layers import Attention, GatedMLP, PackedHead, to_placeholders
from ops.cpu_native import weights as cpu_weights
from ops.cpu_native.build import wants_native
from ops.cpu_native.weights import NativeInt4Weight, NativeInt8Weight
from ops.quant.int_linear import (
    Int8Weight,
    QuantizedLinearWeight,
    activation_dtype,
    check_int4_shape,
    int4_codes,
    pack_int4,
    quantize_int8,
)

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")  # auto: the checkpoint's own (loader)
INT4_GROUP_SIZE = 32  # llama.cpp's Q4_0 / Q4_1 block size
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # one matmul each
TILE_BYTES = 2 << 20  # fp32 bytes of weight rows quantized at a time (`quantize_rows`)
# an fp32 model's quantized linears compute in bf16 on a bf16 CPU (ops/quant/int_linear.py says
# why); TORCH_RUNNER_EXACT_FP32_QUANT=1 keeps them in fp32 (slow, exact: read at import, so
# tensor-parallel ranks inherit it; tests of the exact fp32 kernels set it)
ROUND_FP32_ACTIVATIONS = os.environ.get("TORCH_RUNNER_EXACT_FP32_QUANT", "0") != "1"


def quantize_linears(
    model: nn.Module,
    mode: str,
    int4_sources: dict | None = None,
    head_mode: str | None = None,
    shard=None,
    int8_sources: dict | None = None,
) -> int:
    """Quantize the model's linears in place; returns how many weights were replaced.

    int4_sources: HF weight name -> (codes [N, K], scales, zeros [N, K/32]) already in int4 form
    (a GGUF's Q4 blocks); those are packed as they are, fused rows concatenated, not re-derived,
    and popped from the dict as they are packed (their weights may be meta placeholders).
    int8_sources: HF weight name -> (qweight [N, K] int8, scales [N]) quantized per row already
    (a GGUF read in int8 mode): concatenated as they are, popped likewise.
    head_mode: the lm_head's own mode when it differs (a GGUF with a Q8_0 embedding); default `mode`.
    shard: a tensor-parallel plan (torch_runner/distributed/shard.py) whose `int8_amax(name)`
    gives a row-parallel weight's full-row maxima across the ranks (None for other weights).
    """
    if mode not in ("none", "int8", "int4"):  # fp8: quantize_linears_fp8; auto: the loader's
        raise ValueError(
            f"quantization={mode!r} is not supported; allowed values: none, int8, int4"
        )
    if mode == "none":
        return 0
    count = 0
    int4_sources = int4_sources or {}
    int8_sources = int8_sources or {}

    def quantize(weight: torch.Tensor, name: str, parts=()) -> QuantizedLinearWeight | torch.Tensor:
        out = quantize_one(weight, name, parts)
        if isinstance(out, Int8Weight) and wants_native(out.device):  # AVX2 CPU: q8 activations
            out = NativeInt8Weight(out.qweight, out.scales, weight.dtype,
                                   tiled=cpu_weights.prefers_tiles())  # fmt: skip
        if ROUND_FP32_ACTIVATIONS and isinstance(out, QuantizedLinearWeight):
            out.set_compute_dtype(activation_dtype(weight.dtype, out.device))  # weight: maybe meta
        return_freed_memory()  # the sources and temporaries just freed (glibc keeps them)
        return out

    def quantize_one(weight: torch.Tensor, name: str, parts=()):
        nonlocal count
        names = [f"{name}.{p}.weight" for p in parts] or [f"{name}.weight"]
        if mode == "int8" and all(n in int8_sources for n in names):
            count += 1
            found = [int8_sources.pop(n) for n in names]  # freed once concatenated
            qweight, scales = (torch.cat(a) for a in zip(*found))
            del found
            return Int8Weight(qweight, scales)
        if mode == "int4" and all(n in int4_sources for n in names):
            count += 1
            found = [int4_sources.pop(n) for n in names]  # freed once packed
            codes, scales, zeros = (torch.cat(a) for a in zip(*found))
            del found
            return _pack_int4(codes, scales, zeros, weight.dtype)
        if mode == "int4":
            try:
                check_int4_shape(*weight.shape, INT4_GROUP_SIZE)
            except ValueError as exc:  # said once per weight, never silently
                logger.warning("%s stays unquantized: %s", name, exc)
                return weight
        count += 1
        if mode == "int8" and shard is not None:
            return quantize_int8(weight, shard.int8_amax(name))
        return quantize_rows(weight, mode, INT4_GROUP_SIZE)

    _replace_linears(model, quantize)
    if head_mode not in (None, mode):
        mode = head_mode  # quantize_one reads it: the head's own mode
    if mode != "none":
        _replace_head(model, quantize)
    logger.info("quantization=%s: %d linear weights quantized", mode, count)
    return_freed_memory()
    return count


def _replace_linears(model: nn.Module, quantize) -> None:
    """Replace every decoder layer's fused q/k/v and gate/up matrices, o_proj and down_proj by
    `quantize(weight, name, parts)` (a weight it gives back as a tensor stays as it is); the
    per-projection parameters, views of the fused matrices, become meta placeholders."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Attention):
            if module.qkv_weight is None:
                module.fuse()
            qkv = quantize(module.qkv_weight, name, FUSED_GROUPS[0])
            _replace_buffer(module, "qkv_weight", qkv)
            to_placeholders(module.q_proj, module.k_proj, module.v_proj)
            _replace_weight(module.o_proj, quantize(module.o_proj.weight, f"{name}.o_proj"))
        elif isinstance(module, GatedMLP):
            if module.gate_up_weight is None:
                module.fuse()
            gate_up = quantize(module.gate_up_weight, name, FUSED_GROUPS[1])
            _replace_buffer(module, "gate_up_weight", gate_up)
            to_placeholders(module.gate_proj, module.up_proj)
            _replace_weight(
                module.down_proj, quantize(module.down_proj.weight, f"{name}.down_proj")
            )


def _replace_head(model: nn.Module, quantize) -> None:
    """The lm_head by `quantize(weight, "lm_head")`; a tied model gets a quantized copy of the
    embedding as its head (the embedding stays dense for lookups)."""
    head = getattr(model, "lm_head", False)
    if head is None:
        model.lm_head = PackedHead(model.model.embed_tokens.weight)
        _replace_buffer(
            model.lm_head, "weight", quantize(model.model.embed_tokens.weight, "lm_head")
        )
    elif isinstance(head, nn.Linear):
        _replace_weight(head, quantize(head.weight, "lm_head"))


def quantize_rows(weight: torch.Tensor, mode: str, group_size: int) -> QuantizedLinearWeight:
    """`quantize_weight` a tile of rows at a time: int8 scales and int4 groups are per row, so
    the result is the same, but the fp32 temporaries stay at TILE_BYTES instead of several
    copies of the whole matrix (a tied 49k-row head: ~110 MB each)."""
    n, k = weight.shape
    step = max(8, TILE_BYTES // (4 * k))
    if mode == "int8":
        qweight = torch.empty(n, k, dtype=torch.int8, device=weight.device)
        scales = torch.empty(n, dtype=weight.dtype, device=weight.device)
        for row in range(0, n, step):
            part = quantize_int8(weight[row : row + step])
            qweight[row : row + step], scales[row : row + step] = part.qweight, part.scales
        return Int8Weight(qweight, scales)
    if mode != "int4":
        raise ValueError(f"quantization={mode!r} is not supported; allowed values: int8, int4")
    check_int4_shape(n, k, group_size)
    codes = torch.empty(n, k, dtype=torch.int32, device=weight.device)
    scales, zeros = (torch.empty(n, k // group_size, device=weight.device) for _ in range(2))
    for row in range(0, n, step):
        rows = slice(row, row + step)
        codes[rows], scales[rows], zeros[rows] = int4_codes(weight[rows], group_size)
    return _pack_int4(codes, scales, zeros, weight.dtype, group_size)


def _pack_int4(codes, scales, zeros, dtype, group_size: int = INT4_GROUP_SIZE):
    """Torch's packed int4, or on an AVX2 CPU the native kernels' format (ops/cpu_native: q8
    activations, fp32 scale and min per 32 columns)."""
    if wants_native(codes.device):
        return NativeInt4Weight.from_codes(codes, scales, zeros, group_size, dtype)
    return pack_int4(codes, scales, zeros, group_size, dtype)


def return_freed_memory() -> None:
    """Hand the load-time buffers freed above (dense copies the packed weights replaced) back to
    the OS: glibc keeps them mapped, so the default model's GGUF load stayed at 1432 MB of
    anonymous resident memory instead of 443 MB (tools/bench_cpu_vs_llamacpp.py --memory)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _replace_buffer(module: nn.Module, name: str, value) -> None:
    if isinstance(value, torch.Tensor):
        return
    module._buffers.pop(name, None)  # a buffer slot only takes tensors
    setattr(module, name, value)


def _replace_weight(linear: nn.Linear, value) -> None:
    if isinstance(value, torch.Tensor):
        return
    del linear.weight  # a parameter slot only takes tensors
    linear.weight = value


def quantize_linears_fp8(model: nn.Module) -> int:
    """`--quantization fp8`: every dense decoder linear and the lm_head (a tied model gets an fp8
    copy of the embedding as its head) become e4m3 with per-channel scales, in place; returns how
    many weights were replaced. The same replacement as int8 (module docstring)."""
    from ops.quant.fp8 import quantize_fp8

    count = 0

    def quantize(weight: torch.Tensor, name: str, parts=()):
        nonlocal count
        count += 1
        return quantize_fp8(weight)

    _replace_linears(model, quantize)
    _replace_head(model, quantize)
    logger.info("quantization=fp8: %d linear weights quantized (per-channel e4m3)", count)
    return count
