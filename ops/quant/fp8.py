"""fp8 (e4m3) linear weights: checkpoints' per-tensor, per-channel and 128x128-block scales,
and per-channel quantization of a dense weight at load.

Why `torch._scaled_mm`: on Hopper it multiplies fp8 operands on the tensor cores, so a decode
step streams 1 byte per weight instead of 2. Activations are quantized per token (row) to e4m3 on
the fly, as vLLM's dynamic scheme does: s_x = max|x_row| / 448, one fused Triton kernel
(ops/quant/fp8_triton.py) writes the fp8 row and its scale; the matmul applies s_x [M, 1] and the
weight's per-channel s_w [1, N] to the fp32 accumulator (torch's row-wise scaling, bf16 output).
Decode batches skip the activation quantization where ops/quant/gemv_tiles.py measured it faster
(every shape at one row): the Triton GEMV of ops/quant/gemv_triton.py streams the fp8 weight
with bf16 activations, so those rows also carry no activation rounding.

Block scales on such a GPU: decode rows (up to 8) run the same GEMV with each slice's block scale
applied in registers. Everywhere else (CPU, a GPU without fp8 matmuls, a shape _scaled_mm
refuses, block-scaled prefill) the reference path runs: the weight is dequantised (fp8 -> fp32, times its scales, cast to the
activation dtype) and multiplied densely in the activation dtype, with unquantized activations;
it equals a dense model holding the dequantised weights bit for bit.

Scales multiply: w ~ fp8 * s (what llm-compressor's `weight_scale` and DeepSeek / Qwen3-FP8's
`weight_scale_inv` both mean).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ops.quant.gemv_tiles import MAX_ROWS, fp8_takes_gemv
from ops.quant.int_linear import QuantizedLinearWeight

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_EPS = 1e-12  # an all-zero row gets this scale, not 0 (no 0 / 0)
SCALED_MM_ALIGN = 16  # _scaled_mm needs K and N divisible by 16
# decode batches of up to this many rows may run the weight-only GEMV instead (0: never):
# ops/quant/gemv_triton.py, fp8 weights upcast in registers, activations unquantized, no
# quantize launch; ops/quant/gemv_tiles.py says, per shape and row count, which one measured faster
WEIGHT_ONLY_MAX_ROWS = 8
# the one-row GEMV reads e4m3 as fp32 bits without a conversion instruction: the sign-extended
# byte shifted left 20, masked to this, is the e4m3 value * 2^-E4M3_F32_UNBIAS (subnormals too)
E4M3_F32_MASK = 0x87F00000  # bit 31 (the sign) and bits 20-26 (exponent, mantissa)
E4M3_F32_UNBIAS = 120  # fp32 exponent bias 127 minus e4m3's 7


class Fp8Weight(QuantizedLinearWeight):
    """An [N, K] e4m3 weight with fp32 scales: [N] per channel (a per-tensor scale is stored
    expanded) or [ceil(N / bn), ceil(K / bk)] per (bn, bk) block (`block`)."""

    gemv_kind = "fp8"

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        dtype: torch.dtype,
        block: tuple[int, int] | None = None,
    ):
        super().__init__(*weight.shape, dtype, weight.device)
        self.weight, self.block = weight, block
        self.scale = scale.to(device=weight.device, dtype=torch.float32).contiguous()
        self.uses_scaled_mm = block is None and can_scaled_mm(self.device, *weight.shape)
        # block scales on an fp8 GPU: decode rows run the GEMV with the block scales applied
        # per slice (the reference path would dequantise the whole weight at every matmul)
        self.uses_block_gemv = block is not None and device_fp8_support(self.device) is None
        if self.uses_scaled_mm:
            self.scale_row = self.scale.view(1, -1)  # [1, N] for row-wise scaling
        # the GEMV's bit placement reads an e4m3 NaN byte as 480: such weights take its
        # conversion path (one check, one host sync, at load)
        self.gemv_bits = self.device.type == "cuda" and count_nan(weight) == 0

    def gemv_args(self, x: torch.Tensor) -> tuple | None:
        is_half = x.dtype in (torch.bfloat16, torch.float16)
        if self.uses_block_gemv and is_half and x.shape[0] <= min(WEIGHT_ONLY_MAX_ROWS, MAX_ROWS):
            return self.weight, self.scale, dict(block=self.block, bits=self._bits())
        rows = x.shape[0]
        if (
            self.uses_scaled_mm
            and is_half
            and fp8_takes_gemv(rows, *self.shape, WEIGHT_ONLY_MAX_ROWS)
        ):
            return self.weight, self.scale, dict(bits=self._bits())
        return None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        args = self.gemv_args(x)
        if args is not None:
            from ops.quant.gemv_triton import gemv

            return gemv(x, args[0], args[1], **args[2])
        if not self.uses_scaled_mm:
            return F.linear(x, self.dequantize())
        from ops.quant.fp8_triton import quantize_rows

        xq, x_scale = quantize_rows(x)  # [M, K] e4m3, [M, 1] fp32
        # weight [N, K] row-major: its .t() is the column-major [K, N] _scaled_mm takes
        out = torch._scaled_mm(
            xq, self.weight.t(), scale_a=x_scale, scale_b=self.scale_row, out_dtype=torch.bfloat16
        )
        return out if x.dtype == torch.bfloat16 else out.to(x.dtype)

    def _bits(self) -> bool | None:
        return None if self.gemv_bits else False  # None: the GEMV picks (gemv_tiles.fp8_takes_bits)

    def dequantize(self) -> torch.Tensor:
        """The reference weight [N, K]: fp8 * scale in fp32, rounded once to the activation dtype."""
        return dequantize(self.weight, self.scale, self.block).to(self.dtype)

    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block=None) -> torch.Tensor:
    """fp8 [N, K] times per-channel [N] or block [ceil(N/bn), ceil(K/bk)] scales -> fp32 [N, K]."""
    w = weight.float()
    if block is None:
        return w * scale.float().view(-1, 1)
    n, k = w.shape
    bn, bk = block
    full = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return w * full[:n, :k]


def e4m3_bits_reference(weight: torch.Tensor) -> torch.Tensor:
    """e4m3 [...] -> fp32 e4m3 value * 2^-E4M3_F32_UNBIAS, the one-row GEMV's bit placement in
    torch (its tests' oracle): exact for every code but NaN (0x7F / 0xFF read as 480)."""
    b = weight.view(torch.int8).to(torch.int32)  # sign-extended: the sign's copies in bits 27-31
    return ((b << 20) & (E4M3_F32_MASK - 2**32)).view(torch.float32)


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """A dense [N, K] weight -> e4m3 with per-channel scales max|w_row| / 448."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=SCALE_EPS)  # [N]
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q.contiguous(), scale, weight.dtype)


def scale_layout(
    name: str, weight_shape, scale_shape, block: tuple[int, int] | None
) -> tuple[str, tuple[int, ...]]:
    """Which layout a checkpoint scale has ("tensor", "channel", "block") and the shape it must
    have; a scale of any other shape is a ValueError naming the tensor and the shapes allowed."""
    n, k = weight_shape
    shape = tuple(scale_shape)
    if block is not None:
        bn, bk = block
        want = (-(-n // bn), -(-k // bk))
        if shape == want:
            return "block", want
        allowed = f"{want} (blocks of {bn}x{bk})"
    else:
        numel = 1
        for s in shape:
            numel *= s
        if numel == 1 and len(shape) <= 2:
            return "tensor", shape
        if shape in ((n,), (n, 1)):
            return "channel", shape
        allowed = f"() or (1,) per tensor, ({n},) or ({n}, 1) per channel"
    raise ValueError(
        f"tensor {name!r} has shape {shape} for a [{n}, {k}] fp8 weight; allowed: {allowed}"
    )


def from_checkpoint(
    name: str, weight: torch.Tensor, scale: torch.Tensor, dtype, block=None
) -> Fp8Weight:
    """A checkpoint's e4m3 weight and its scale tensor `name` (checked by `scale_layout`)."""
    layout, _ = scale_layout(name, weight.shape, scale.shape, block)
    if layout == "tensor":
        scale = scale.float().reshape(1).expand(weight.shape[0])
    elif layout == "channel":
        scale = scale.float().reshape(-1)
    return Fp8Weight(weight, scale.float(), dtype, block if layout == "block" else None)


def count_nan(weight: torch.Tensor) -> int:
    """e4m3fn NaNs (bytes S.1111.111; the format has no inf). A load-time check: one host sync."""
    return int(((weight.view(torch.uint8) & 0x7F) == 0x7F).sum().item())


@functools.cache
def _device_has_fp8(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)  # Ada and Hopper have fp8 MMA


def can_scaled_mm(device: torch.device, n: int, k: int) -> bool:
    """True when `_scaled_mm` can run this [N, K] weight on `device` (CUDA, fp8 MMA, aligned)."""
    if device.type != "cuda" or n % SCALED_MM_ALIGN or k % SCALED_MM_ALIGN:
        return False
    return _device_has_fp8(device.index if device.index is not None else 0)


def device_fp8_support(device: torch.device) -> str | None:
    """None when `device` multiplies fp8 on its matrix units, else why not (for the load error)."""
    if device.type != "cuda":
        return (
            f"device {device.type} has no fp8 matmul (needs a CUDA GPU of compute capability 8.9+)"
        )
    if not _device_has_fp8(device.index if device.index is not None else 0):
        cap = torch.cuda.get_device_capability(device)
        return f"this GPU has compute capability {cap[0]}.{cap[1]}; fp8 matmuls need 8.9+"
    return None
