"""The pure-torch definition of the native kernels' math (the tests' oracle, and the fallback
when the library cannot be built: the same results, slower).

int8 / int4 CPU linears quantize their activations per 32 values (q8 blocks, as llama.cpp's
q8_0 / q8_1): d = amax / 127, q = round(x * (127 / amax)) half to even (0 where amax is 0),
zero-padded past K; the product is then that dequantised x times the dequantised weight, in fp32.
The kernels compute the same sum with exact integer block dot products; only the fp32 summation
order differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 32  # values per activation scale


def quantize_q8(x: torch.Tensor):
    """x [M, K] -> (codes int8 [M, Kp], d [M, Kp/32], d * sum(codes) [M, Kp/32]), Kp = K up to 32."""
    m, k = x.shape
    kp = -(-k // BLOCK) * BLOCK
    blocks = F.pad(x.float(), (0, kp - k)).view(m, kp // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)  # [M, Kp/32]
    d = amax / 127
    # a true division, as the kernel's (`127 / tensor` is reciprocal-then-multiply: two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    codes = torch.round(blocks * inv[..., None])
    return codes.to(torch.int8).view(m, kp), d, d * codes.sum(dim=-1)


def dequantize_q8(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> its q8 rounding, fp32 [M, K]."""
    codes, d, _ = quantize_q8(x)
    m, k = x.shape
    return (codes.float().view(m, -1, BLOCK) * d[..., None]).view(m, -1)[:, :k]


def finish(y: torch.Tensor, dtype, bias, residual) -> torch.Tensor:
    """fp32 result + bias + residual, rounded once to `dtype` (as the kernels' epilogue)."""
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.float()
    return y.to(dtype)


def dense_linear(x, w, bias=None, residual=None) -> torch.Tensor:
    return finish(x.float() @ w.float().T, x.dtype, bias, residual)


def tile_rows(w: torch.Tensor, width: int = 16) -> torch.Tensor:
    """[N, K] -> the tiling [N / 4, K / width, 4, width] (linear.h: dense tiles of 16 values,
    int8 codes of 32); N % 4 == 0, K % width == 0."""
    n, k = w.shape
    return w.reshape(n // 4, 4, k // width, width).transpose(1, 2).contiguous()


def untile_rows(tiles: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """tile_rows' inverse: [N / 4, K / width, 4, width] -> [N, K] (a copy; into `out`, a
    contiguous [N, K], when given)."""
    nb, kc, rows, width = tiles.shape
    if out is None:
        return tiles.transpose(1, 2).reshape(nb * rows, kc * width)
    out.view(nb, rows, kc, width).copy_(tiles.transpose(1, 2))
    return out


def dense_packed_linear(x, tiles, bias=None, residual=None) -> torch.Tensor:
    return dense_linear(x, untile_rows(tiles), bias, residual)


def int8_weight(qw: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """qw [N, Kp] int8, scales [N] -> fp32 [N, K]."""
    return qw[:, :k].float() * scales.float()[:, None]


def int4_weight(qs: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """qs [N, K/32, 16] uint8 (byte j: code j | code j+16 << 4), dm [N, 2, K/32] (each row's
    scales, then its mins) -> fp32 [N, K]."""
    n, nb, _ = qs.shape
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [N, K/32, 32]
    dm = dm.float()
    return (codes * dm[:, 0, :, None] + dm[:, 1, :, None]).view(n, nb * BLOCK)


def int8_linear(x, qw, scales, k, bias=None, residual=None) -> torch.Tensor:
    y = dequantize_q8(x) @ int8_weight(qw, scales, k).T
    return finish(y, x.dtype, bias, residual)


def int4_linear(x, qs, dm, bias=None, residual=None) -> torch.Tensor:
    return finish(dequantize_q8(x) @ int4_weight(qs, dm).T, x.dtype, bias, residual)
