"""Linear weights in the native kernels' formats; `ops.linear` / `ops.linear_add` call them.

Dense fp32 / bf16 keep the tensor they wrap (no copy): a product of up to DENSE_MAX_ROWS rows
(decode) runs the native GEMV, a longer one (prefill) MKL through F.linear. int8 / int4 weights
are re-packed once at load (linear_kernels.cpp says the layouts) and every product of theirs, of
any row count, runs the q8-activation math (reference.py), natively or, without the library,
through the reference (same results).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ops.cpu_native import reference
from ops.cpu_native.build import isa, native_ops
from ops.quant.int_linear import QuantizedLinearWeight

DENSE_MAX_ROWS = 8  # more rows: MKL's GEMM reuses the weights better than the per-row GEMV
TILED_FP32_MAX_ROWS = 64  # NativePackedDenseWeight: fp32 products of more rows run MKL
# NativePackedDenseWeight._untiled's scratch, one per thread (engines may step in parallel threads)
_UNTILED = threading.local()
UNTILED_MAX_BYTES = 64 << 20  # a larger matrix untiles into a temporary (no lasting scratch)


class NativeWeight(QuantizedLinearWeight):
    """Base: `linear_add` adds the residual inside the kernel (one rounding, no extra pass)."""

    def __init__(self, out_features: int, in_features: int, dtype, device):
        super().__init__(out_features, in_features, dtype, device)
        # torch.ops.torch_runner_native, or None (the reference); resolved here, not per call,
        # so the compiled step (torch.compile) sees a plain attribute
        self.lib = native_ops()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.linear_add(x, bias, None)

    def linear_add(self, x, bias, residual) -> torch.Tensor:
        flat = x.reshape(-1, self.shape[1]).contiguous()  # [M, K]
        res = None if residual is None else residual.reshape(flat.shape[0], -1).contiguous()
        return self.run(flat, bias, res).view(*x.shape[:-1], self.shape[0])

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """No-op: the q8 activation rounding is this format's own (it needs no bf16 rounding)."""

    def run(self, x, bias, residual) -> torch.Tensor:
        raise NotImplementedError

    def step_fields(self) -> tuple:
        """(kind, a, b): this weight as decode_step (decode_step.cpp) takes it."""
        raise NotImplementedError


class NativeDenseWeight(NativeWeight):
    def __init__(self, weight: torch.Tensor):
        super().__init__(*weight.shape, weight.dtype, weight.device)
        self.weight = weight.detach().contiguous()  # [N, K] fp32 or bf16

    def run(self, x, bias, residual):
        lib = self.lib
        if x.shape[0] <= DENSE_MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16):
            if lib is not None:
                return lib.dense_linear(x, self.weight, bias, residual)
            return reference.dense_linear(x, self.weight, bias, residual)
        out = F.linear(x, self.weight.to(x.dtype), bias)
        return out if residual is None else out.add_(residual)

    def step_fields(self) -> tuple:
        return 0, self.weight, None

    def nbytes(self) -> int:
        return self.weight.nbytes


class NativePackedDenseWeight(NativeWeight):
    """Dense fp32 / bf16 tiled [N / 4, K / 16, 4, 16] (reference.tile_rows; linear.h says why):
    the same products as NativeDenseWeight, bit for bit, with the weight read as one stream.

    Products of many rows (prefill, wide decode batches) stay on the native kernel too: bf16
    always (torch's bf16 matmul ran at ~18 GFLOPS on the AVX2 box, the kernel at ~80), fp32 up
    to TILED_FP32_MAX_ROWS rows, past which MKL's GEMM on an untiled copy [N, K] (a per-thread
    scratch buffer, `_untiled`) wins (8 gate/up matrices, ms: M=64 native 18.1 / MKL 22.4,
    M=256 86.1 / 57.9; log session 28)."""

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        if n % 4 or k % 16:
            raise ValueError(f"packed dense: N={n} must be a multiple of 4 and K={k} of 16")
        super().__init__(n, k, weight.dtype, weight.device)
        self.tiles = reference.tile_rows(weight.detach())

    def run(self, x, bias, residual):
        lib = self.lib
        is_few = self.dtype == torch.bfloat16 or x.shape[0] <= TILED_FP32_MAX_ROWS
        if is_few and x.dtype in (torch.float32, torch.bfloat16):
            if lib is not None:
                return lib.dense_packed_linear(x, self.tiles, bias, residual)
            return reference.dense_packed_linear(x, self.tiles, bias, residual)
        out = F.linear(x, self._untiled().to(x.dtype), bias)
        return out if residual is None else out.add_(residual)

    def _untiled(self) -> torch.Tensor:
        """The weight [N, K] in a scratch buffer shared by every tiled weight of this dtype on
        this thread (each product uses it before the next starts): a fresh [N, K] per product
        page-faulted its pages in every time (fp32 prefill of 512 tokens 1.14 s against 0.99
        for row weights; log session 28)."""
        n, k = self.shape
        if n * k * self.tiles.element_size() > UNTILED_MAX_BYTES:  # e.g. a large vocabulary
            return reference.untile_rows(self.tiles)
        scratch = _UNTILED.__dict__.setdefault("by_dtype", {})
        held = scratch.get(self.dtype)
        if held is None or held.numel() < n * k:
            with torch.inference_mode(False):  # a normal tensor: writable in and out of the mode
                held = scratch[self.dtype] = torch.empty(n * k, dtype=self.dtype)
        return reference.untile_rows(self.tiles, out=held[: n * k].view(n, k))

    def dequantize(self) -> torch.Tensor:
        return reference.untile_rows(self.tiles)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows [*ids, K] of the weight (row t: tiles[t // 4, :, t % 4]; a tied embedding's lookup)."""
        return self.tiles[ids // 4, :, ids % 4].reshape(*ids.shape, self.shape[1])

    def step_fields(self) -> tuple:
        return 4, self.tiles, None

    def nbytes(self) -> int:
        return self.tiles.nbytes


# decode_step's kind of an int8 weight (linear.h Kind), by (tiled, -128 codes)
_INT8_KINDS = {(False, False): 1, (False, True): 3, (True, False): 5, (True, True): 6}


def prefers_tiles() -> bool:
    """Whether weights take the tiled layouts (NativePackedDenseWeight, NativeInt8Weight's
    `tiled`): with the AVX2 kernels, where they were measured (TORCH_RUNNER_CPU_ISA=avx2 picks
    those on an AVX-512 CPU too)."""
    return isa() == "avx2"


class NativeInt8Weight(NativeWeight):
    """Per-row int8: qweight [N, Kp] (zero columns past K), fp32 scales [N]; `tiled` (where N %
    4 == 0): the codes as [N / 4, Kp / 32, 4, 32] (reference.tile_rows; linear.h int8_dot says
    why), the same products bit for bit."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 tiled: bool = False):  # fmt: skip
        n, k = qweight.shape
        super().__init__(n, k, dtype, qweight.device)
        # -128 codes take the kernel's full-range variant (one more op a row: linear.h int8_dot)
        self.is_full_range = bool(qweight.numel()) and int(qweight.min()) == -128
        kp = -(-k // reference.BLOCK) * reference.BLOCK
        self.qweight = F.pad(qweight, (0, kp - k)).contiguous()
        self.is_tiled = tiled and n % 4 == 0
        if self.is_tiled:
            self.qweight = reference.tile_rows(self.qweight, reference.BLOCK)
        self.scales = scales.float().contiguous()

    def rows(self) -> torch.Tensor:
        """The codes [N, Kp] (a copy when tiled)."""
        return reference.untile_rows(self.qweight) if self.is_tiled else self.qweight

    def run(self, x, bias, residual):
        k, lib = self.shape[1], self.lib
        if lib is not None:
            return lib.int8_linear(x, self.qweight, self.scales, k, bias, residual,
                                   self.is_full_range)  # fmt: skip
        return reference.int8_linear(x, self.rows(), self.scales, k, bias, residual)

    def dequantize(self) -> torch.Tensor:
        return reference.int8_weight(self.rows(), self.scales, self.shape[1]).to(self.dtype)

    def step_fields(self) -> tuple:
        return _INT8_KINDS[self.is_tiled, self.is_full_range], self.qweight, self.scales

    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


class NativeInt4Weight(NativeWeight):
    """Per 32 columns: qs [N, K/32, 16] uint8 codes as llama.cpp's Q4_1 blocks; their fp16
    (scale, min) pairs dm [N, K/32, 2] (a GGUF's Q4_1 d / m are fp16 already: kept exactly) are
    stored as dm [N, 2, K/32], each row's scales then its mins (the kernel loads 8 at a time)."""

    def __init__(self, qs: torch.Tensor, dm: torch.Tensor, dtype: torch.dtype):
        n, nb, _ = qs.shape
        super().__init__(n, nb * reference.BLOCK, dtype, qs.device)
        self.qs, self.dm = qs.contiguous(), dm.transpose(1, 2).contiguous()

    @classmethod
    def from_codes(cls, codes, scales, zeros, group_size: int, dtype) -> NativeInt4Weight:
        """Codes [N, K] 0..15 with scales / zeros [N, K/g] (w = (code - 8) * scale + zero)."""
        n, k = codes.shape
        if k % reference.BLOCK or group_size % reference.BLOCK:
            raise ValueError(
                f"native int4: K={k} and group_size={group_size} must be multiples of 32"
            )
        per = group_size // reference.BLOCK  # 32-blocks per group
        scale = scales.float().repeat_interleave(per, dim=1)  # [N, K/32]
        low = zeros.float().repeat_interleave(per, dim=1) - 8 * scale
        blocks = codes.to(torch.uint8).view(n, k // reference.BLOCK, reference.BLOCK)
        qs = blocks[..., :16] | (blocks[..., 16:] << 4)
        dm = torch.stack([scale, low], dim=-1).to(torch.float16)
        if not torch.isfinite(dm).all():
            raise ValueError("native int4: a scale or min is outside float16's range (65504)")
        return cls(qs, dm, dtype)

    def run(self, x, bias, residual):
        lib = self.lib
        if lib is not None:
            return lib.int4_linear(x, self.qs, self.dm, bias, residual)
        return reference.int4_linear(x, self.qs, self.dm, bias, residual)

    def dequantize(self) -> torch.Tensor:
        return reference.int4_weight(self.qs, self.dm).to(self.dtype)

    def step_fields(self) -> tuple:
        return 2, self.qs, self.dm

    def nbytes(self) -> int:
        return self.qs.nbytes + self.dm.nbytes
