"""MXFP4 (OCP microscaling FP4) dequantisation for gpt-oss expert weights.

Real gpt-oss checkpoints store each expert matrix as `<name>_blocks` [E, R, G, 16] uint8 (two
FP4 E2M1 codes per byte, the LOW nibble holding the even element) and `<name>_scales` [E, R, G]
uint8 (one shared exponent per 32-element group, value 2^(s - 127)). We dequantise once at load
to the dense layout the model keeps: `[E, G*32, R]`, i.e. the checkpoint's row-major [R, C]
matrix transposed, which is how transformers' GptOssExperts stores `gate_up_proj`/`down_proj`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.safetensors_io import FileTensor, Origins, file_reads, lazy_tensor
from ops.quant.mxfp4 import FP4_E2M1_VALUES, SCALE_BIAS  # one code table for both paths

ROWS_PER_CHUNK = 1 << 16  # bounds the int64 index temporaries on real 20B/120B checkpoints


def check_pair(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless `blocks` [E, R, G, B] and `scales` [E, R, G] are a uint8 MXFP4 pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8, found {blocks.dtype}/{scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            "(expected blocks [E, R, G, B] and scales [E, R, G])"
        )


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[E, R, G, 16] uint8 blocks + [E, R, G] uint8 scales -> [E, G*32, R] in `dtype`."""
    check_pair(blocks, scales)
    num_experts, num_rows, num_groups, group_bytes = blocks.shape
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    flat_blocks = blocks.reshape(-1, group_bytes)  # [E*R*G, 16]
    flat_scales = scales.reshape(-1, 1).to(torch.int32) - SCALE_BIAS  # [E*R*G, 1]
    out = torch.empty(flat_blocks.shape[0], group_bytes * 2, dtype=dtype)  # [E*R*G, 32]
    for start in range(0, flat_blocks.shape[0], ROWS_PER_CHUNK):
        stop = start + ROWS_PER_CHUNK
        packed = flat_blocks[start:stop]
        values = torch.empty(packed.shape[0], group_bytes * 2, dtype=torch.float32)
        values[:, 0::2] = lut[(packed & 0x0F).long()]  # low nibble = even element
        values[:, 1::2] = lut[(packed >> 4).long()]
        out[start:stop] = torch.ldexp(values, flat_scales[start:stop].float()).to(dtype)
    dense = out.view(num_experts, num_rows, num_groups * group_bytes * 2)  # [E, R, C]
    return dense.transpose(1, 2).contiguous()  # [E, C, R]


def dequantize_mxfp4_weights(
    weights: dict[str, torch.Tensor], dtype: torch.dtype, origins: Origins | None = None
) -> dict[str, torch.Tensor]:
    """Replace every `<name>_blocks` / `<name>_scales` pair by the dense `<name>` tensor. With
    `origins` (the loader's record of file reads) a pair read from the file becomes a meta tensor
    dequantized at fill time, one expert at a time, straight into its buffer (DequantizedRead)."""
    out = dict(weights)
    reads = file_reads(origins) if origins else {}
    for key in [k for k in weights if k.endswith("_blocks")]:
        base = key.removesuffix("_blocks")
        scale_key = f"{base}_scales"
        if scale_key not in weights:
            raise ValueError(f"MXFP4 tensor {key!r} has no matching {scale_key!r}")
        blocks, scales = out.pop(key), out.pop(scale_key)
        if id(blocks) in reads and id(scales) in reads:
            check_pair(blocks, scales)
            num_experts, rows, groups, group_bytes = blocks.shape
            shape = (num_experts, groups * group_bytes * 2, rows)  # [E, C, R]
            reader = DequantizedRead(reads[id(blocks)], reads[id(scales)], shape, dtype)
            out[base] = lazy_tensor(origins, base, shape, dtype, reader)
        else:
            out[base] = dequantize_mxfp4(blocks, scales, dtype)
    return out


@dataclass(frozen=True)
class DequantizedRead:
    """A dense [E, C, R] expert tensor from its MXFP4 blocks and scales in the file: the packed
    bytes (about a quarter of the dense size in bf16) read with pread, then each expert
    dequantized into its row of the output, so no whole-tensor temporary exists beside it."""

    blocks: FileTensor
    scales: FileTensor
    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None):
        blocks, scales = self.blocks.read(scratch=scratch), self.scales.read(scratch=scratch)
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype)
        for expert in range(self.shape[0]):  # at load: one expert's temporaries at a time
            out[expert] = dequantize_mxfp4(blocks[expert : expert + 1],
                                           scales[expert : expert + 1], self.dtype)[0]  # fmt: skip
        return out
