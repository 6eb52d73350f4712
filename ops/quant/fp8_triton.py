"""CUDA: per-token (row) e4m3 quantization of activations in one Triton kernel, for the fp8
`_scaled_mm` path (ops/quant/fp8.py).

Why a kernel: with torch ops the amax, divide, clamp and cast are four launches and three extra
passes per linear; at batch 1 those launches cost more than the matmul saves. One program per
row loads the whole row once (K <= 16384 on the models served), takes max|x|, writes
x / s clamped to +-448 as e4m3 and s = max(max|x| / 448, 1e-12) as fp32 [M, 1]. No host sync;
shapes depend on M alone, so CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.quant.fp8 import FP8_DTYPE, FP8_MAX, SCALE_EPS


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, K, stride_x, FMAX: tl.constexpr, EPS: tl.constexpr,
                   BLOCK_K: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FMAX, EPS)
    q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
    tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 / fp16 / fp32, last dim contiguous) -> (e4m3 [M, K], fp32 scales [M, 1])."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _quantize_rows[(m,)](x, q, scales, k, x.stride(0), FMAX=FP8_MAX, EPS=SCALE_EPS,
                         BLOCK_K=block, num_warps=warps)  # fmt: skip
    return q, scales


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same quantization in plain torch ops (the GPU tests' oracle)."""
    xf = x.float()
    scales = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=SCALE_EPS)
    return (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales
