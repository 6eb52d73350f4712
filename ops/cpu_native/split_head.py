"""An fp32 lm_head held as two 16-bit planes of its packed tiles (head_kernels.cpp says the math).

hi: each weight's top 16 bits (a bf16: the value truncated), lo: its low 16 bits, both tiled
[N / 4, K / 16, 4, 16]: the same bytes as the fp32 tiles. Products read both planes and are the
exact fp32 product; a greedy pick reads hi for every row (half the bytes) and both planes only for
the rows a per-row error bound cannot rule out, which gives the same token as the argmax of the
full product. Why: the default model's tied head is ~20% of an fp32 decode step's bytes
(docs/performance-log.md, session 31).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.cpu_native import reference
from ops.cpu_native.weights import TILED_FP32_MAX_ROWS, NativeWeight

CHUNK_ROWS = 512  # rows split at a time: the load's temporaries stay a few MB (fp64 norms)
UNIT_ROUNDOFF = 2.0**-24  # fp32


class NativeSplitHeadWeight(NativeWeight):
    """fp32 [N, K] (N % 4 == 0, K % 16 == 0) as planes `hi` (bf16) and `lo` (int16), with per-row
    bounds `err` [N]: |exact_j - approx_j| <= |x|_2 err[j] for the computed fp32 products of x
    with row j and with its hi part (head_kernels.cpp's top comment derives it)."""

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        if n % 4 or k % 16 or weight.dtype != torch.float32:
            raise ValueError(
                f"split head: want fp32 [N, K] with N % 4 == 0 and K % 16 == 0; got "
                f"{weight.dtype} {tuple(weight.shape)}"
            )
        super().__init__(n, k, torch.float32, weight.device)
        self.hi = torch.empty(n // 4, k // 16, 4, 16, dtype=torch.bfloat16)
        self.lo = torch.empty(n // 4, k // 16, 4, 16, dtype=torch.int16)
        self.err = torch.empty(n, dtype=torch.float32)
        # the error of a computed k-term dot product, relative to |x|_2 |w|_2 (Higham's gamma_k;
        # +2 terms of slack for the horizontal sums)
        gamma = (k + 2) * UNIT_ROUNDOFF / (1 - (k + 2) * UNIT_ROUNDOFF)
        self.wmax = 0.0  # max_j |w_j|_2
        for start in range(0, n, CHUNK_ROWS):
            w = weight[start : start + CHUNK_ROWS].detach().float()
            bits = reference.tile_rows(w).view(torch.int32)
            at = slice(start // 4, (start + w.shape[0]) // 4)
            self.hi[at] = (bits >> 16).to(torch.int16).view(torch.bfloat16)
            self.lo[at] = ((bits << 16) >> 16).to(torch.int16)  # the low half, sign-extended
            top = (w.view(torch.int32) & -65536).view(torch.float32).double()
            norms = w.double().norm(dim=1)
            bound = (w.double() - top).norm(dim=1) + 2 * gamma * norms
            # rounded up past fp32's rounding of the stored bound
            self.err[start : start + w.shape[0]] = (bound * (1 + 2.0**-20)).float()
            self.wmax = max(self.wmax, float(norms.max()) if norms.numel() else 0.0)
        # a non-finite weight: the bound means nothing, every pick takes the full product
        self.can_screen = bool(torch.isfinite(self.err).all()) and self.wmax < float("inf")

    def run(self, x, bias, residual):
        lib = self.lib
        if lib is not None and x.shape[0] <= TILED_FP32_MAX_ROWS:
            out = lib.split_linear(
                x.float(),
                self.hi,
                self.lo,
                None if bias is None else bias.float(),
                None if residual is None else residual.float(),
            )
            return out.to(x.dtype)
        out = F.linear(x, self.dequantize().to(x.dtype), bias)  # many rows: MKL's GEMM
        return out if residual is None else out.add_(residual)

    def greedy(self, x: torch.Tensor, vocab: int):
        """(ids [M] int64, finite [M] bool): per row of x [M, K] the first index of the maximum
        of the first `vocab` columns of this product (every logit finite), or None where some
        row could not be decided so (x not fp32 or not finite, no native library, a non-finite
        weight): the caller then computes the logits."""
        lib = self.lib
        if lib is None or not self.can_screen or x.dtype != torch.float32 or x.dim() != 2:
            return None
        ids, ok = lib.split_greedy(x.contiguous(), self.hi, self.lo, self.err, vocab, self.wmax)
        return (ids, ok) if bool(ok.all()) else None  # CPU tensors: no device sync

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 rows [*ids, K] of token ids (a tied embedding's lookup), bit for bit."""
        hi = self.hi[ids // 4, :, ids % 4].view(torch.int16)  # [*ids, K / 16, 16]
        lo = self.lo[ids // 4, :, ids % 4]
        return _join(hi, lo).reshape(*ids.shape, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K] (a copy)."""
        n, k = self.shape
        out = torch.empty(n, k, dtype=torch.float32)
        for start in range(0, n // 4, CHUNK_ROWS // 4):
            at = slice(start, start + CHUNK_ROWS // 4)
            tiles = _join(self.hi[at].view(torch.int16), self.lo[at])
            reference.untile_rows(tiles, out=out[start * 4 : start * 4 + tiles.shape[0] * 4])
        return out

    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes + self.err.nbytes


def _join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """int16 planes -> the fp32 values whose top / low 16 bits they are."""
    return ((hi.to(torch.int32) << 16) | (lo.to(torch.int32) & 0xFFFF)).view(torch.float32)
