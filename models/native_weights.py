"""Dense fp32 / bf16 decode matmuls onto the native CPU GEMV (ops/cpu_native), in place.

With the AVX2 kernels (ops/cpu_native/build.isa) the decoder's matrices are re-tiled for the
GEMV (NativePackedDenseWeight: one weight stream per row block, linear.h says why) and the
q/k/v and gate/up parameters, views of the fused matrices, become `meta` placeholders as
oneDNN packing leaves them (memory neutral; the state dict is no longer a checkpoint). A tied
lm_head is tiled too and the embedding then looks its rows up in the tiles (TiledEmbedding), so
the vocabulary is held once; an fp32 head is tiled as two 16-bit planes (split_head.py: the
same bytes, and a greedy pick that reads about half of them).

Why: on the AVX2-only box MKL / oneDNN streamed the batch-1 matrices at 12-19 GB/s around a
large per-call overhead; the native GEMV is the same fp32-accumulated product (summation order
aside) without it (docs/performance-log.md, 2026-12-03 cpunative). Without tiles each weight
is wrapped, not copied (NativeDenseWeight keeps the tensor), so the q/k/v and gate/up views stay
valid and a prefill's product of many rows runs MKL through F.linear (the tiles: weights.py says
which products leave the kernel). int8 / int4 weights get their native formats where
models/quantize.py packs them.
"""

from __future__ import annotations

import torch
from torch import nn

from models.layers import Attention, GatedMLP, PackedHead, to_placeholders
from models.quantize import return_freed_memory
from ops.cpu_native import hugepages
from ops.cpu_native import weights as cpu_weights
from ops.cpu_native.build import native_ops
from ops.cpu_native.split_head import NativeSplitHeadWeight
from ops.cpu_native.weights import NativeDenseWeight, NativePackedDenseWeight
from ops.quant.int_linear import QuantizedLinearWeight

DTYPES = (torch.float32, torch.bfloat16)
TILED = (NativePackedDenseWeight, NativeSplitHeadWeight)  # weights of the tiled layouts


def native_linear_weights(model: nn.Module) -> int:
    """Wrap every fused q/k/v and gate/up matrix, o_proj, down_proj and the lm_head (a tied one:
    the embedding matrix, shared) in NativeDenseWeight, or NativePackedDenseWeight where
    `prefers_tiles()` (ops/cpu_native/weights.py); returns how many were wrapped."""
    count = 0
    tiles = cpu_weights.prefers_tiles()

    def wrap(weight, pack: bool, is_head: bool = False):
        nonlocal count
        if not isinstance(weight, torch.Tensor) or weight.dtype not in DTYPES:
            return weight
        count += 1
        n, k = weight.shape
        if pack and tiles and n % 4 == 0 and k % 16 == 0:
            if is_head and weight.dtype == torch.float32 and native_ops() is not None:
                return NativeSplitHeadWeight(weight)  # the screened greedy pick
            return NativePackedDenseWeight(weight)
        return NativeDenseWeight(weight)

    def wrap_param(linear: nn.Linear, pack: bool = True, is_head: bool = False) -> None:
        value = wrap(linear.weight, pack, is_head)
        if not isinstance(value, torch.Tensor):
            del linear.weight  # a parameter slot only takes tensors
            linear.weight = value

    def wrap_buffer(module: nn.Module, name: str, parts=(), pack=True, is_head=False) -> None:
        value = wrap(getattr(module, name), pack, is_head)
        if not isinstance(value, torch.Tensor):
            module._buffers.pop(name, None)
            setattr(module, name, value)
        if isinstance(value, TILED):  # the parts' views would pin the rows
            to_placeholders(*parts)

    for module in list(model.modules()):
        if tiles and isinstance(module, (Attention, GatedMLP)):
            return_freed_memory()  # the rows each packed copy replaced (peak: weights + one matrix)
        if isinstance(module, Attention):
            if module.qkv_weight is None:
                module.fuse()
            wrap_buffer(module, "qkv_weight", (module.q_proj, module.k_proj, module.v_proj))
            wrap_param(module.o_proj)
        elif isinstance(module, GatedMLP):
            if module.gate_up_weight is None:
                module.fuse()
            wrap_buffer(module, "gate_up_weight", (module.gate_proj, module.up_proj))
            wrap_param(module.down_proj)
    head = getattr(model, "lm_head", False)
    if head is None:  # tied: the embedding is also the lm_head
        embed = model.model.embed_tokens
        model.lm_head = PackedHead(embed.weight)
        is_full = type(embed) is nn.Embedding  # not a vocab shard
        wrap_buffer(model.lm_head, "weight", pack=is_full, is_head=True)
        if isinstance(model.lm_head.weight, TILED):
            model.model.embed_tokens = TiledEmbedding(model.lm_head.weight)
    elif isinstance(head, nn.Linear):
        wrap_param(head, is_head=True)
    if tiles:
        return_freed_memory()
    return count


class TiledEmbedding(nn.Module):
    """A tied model's embedding once its lm_head is tiled: token t's row is read from the head's
    tiles (`rows`), the same values as the dense table, which is freed. `weight` is no longer a
    tensor: a lookup is this module's call."""

    def __init__(self, head: NativePackedDenseWeight | NativeSplitHeadWeight):
        super().__init__()
        self.head = head
        self.num_embeddings, self.embedding_dim = head.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head.rows(input_ids)  # [*ids, H]


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of `model` and the tensors inside its packed / quantized
    linear weights (module attributes that are QuantizedLinearWeight objects)."""
    found = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, QuantizedLinearWeight):
                found += [t for t in vars(value).values() if isinstance(t, torch.Tensor)]
    return found


def weights_on_huge_pages(model: nn.Module) -> int:
    """Back the model's CPU weights with 2 MiB pages in place (ops/cpu_native/hugepages.py);
    returns the bytes collapsed."""
    return hugepages.collapse(weight_tensors(model))
