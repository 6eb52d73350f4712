"""Weight-only int8 (per output channel) and int4 (per group of input columns) linear weights.

Why torch's own kernels: `aten._weight_int8pack_mm` and `aten._weight_int4pack_mm_for_cpu` (CUDA:
`_weight_int4pack_mm`, bf16 only) read the packed weights and dequantise inside the matmul, so a
decode step streams 1 / 0.5 byte per weight instead of 2 (bf16) or 4 (fp32). An object of
this module stands where a weight tensor stood; `ops.linear` sees `is_quantized` and calls it.
Except: CUDA int8 at decode shapes (up to INT8_GEMV_MAX_ROWS rows) runs the Triton GEMV of
ops/quant/gemv_triton.py, since torch's CUDA int8 kernel is slow at one row.

Formats (the oracles in tests/test_ops_quant_int.py dequantise them with plain torch ops):
- int8: q [N, K] int8 = round(w / s), s [N] = max|w_row| / 127; w ~ q * s.
- int4: q in 0..15 per group of `group_size` columns, w ~ (q - 8) * scale + zero with
  scale = (max - min) / 15 and zero = min + 8 * scale (the layout torch's int4 kernels take:
  scales_and_zeros [K / group, N, 2]).

The compute dtype (`set_compute_dtype`): torch's CPU kernels with fp32 activations take a slow
path, 10x (int8) to 25x (int4) slower than with bf16 activations on the 2-core AVX512-BF16 box
(tools/bench_quant.py --op) and 6x / 12x on the AVX2-only EPYC (no native bf16). So on CPU an fp32
model's quantized linears round their input to bf16, run the kernel in bf16 (fp32 accumulation
inside) and return fp32, as llama.cpp rounds its activations (to q8_0) for quantized matmuls.
models/quantize.py applies that rule; a weight built directly computes in its own dtype.
"""

from __future__ import annotations

import functools

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_INNER_K_TILES = 2
MODES = ("int8", "int4")
# CUDA: int8 linears of up to this many rows (decode) run the Triton GEMV
# (ops/quant/gemv_triton.py): at one row torch's `_weight_int8pack_mm` took 5.7-21x its time on
# the Llama-1B / 8B projections (H200, tools/bench_fp8_linear.py, docs/performance-log.md), and
# the GEMV's 8-row time is 1.3-6.9x its 1-row time (torch's kernel at 8 rows was not timed)
INT8_GEMV_MAX_ROWS = 8


class QuantizedLinearWeight:
    """Base of the packed weights: [out, in] like the tensor it replaces (for shape checks)."""

    is_mkldnn = False  # ops.linear asks a weight these two before choosing a kernel
    is_quantized = True
    gemv_kind: str | None = None  # "fp8" / "int8": the Triton GEMV's weight kind (gemv_args)

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, device):
        self.shape = torch.Size((out_features, in_features))
        self.dtype = dtype
        self.device = torch.device(device)

        self.compute_dtype = dtype

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, self.shape[1])  # [M, K]
        if self.compute_dtype != flat.dtype:  # fp32 model on a bf16 CPU: see the module doc
            out = self.matmul(flat.to(self.compute_dtype)).to(x.dtype)
        else:
            out = self.matmul(flat)
        out = out.view(*x.shape[:-1], self.shape[0])
        return out if bias is None else out.add_(bias)

    def linear_add(self, x, bias, residual) -> torch.Tensor:
        """`linear(x, bias) + residual`."""
        return self.linear(x, bias).add_(residual)

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """Run the kernel on `dtype` activations (the scales get a copy in `dtype`)."""
        self.compute_dtype = dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gemv_args(self, x: torch.Tensor) -> tuple | None:
        """(weight, scale, keyword arguments) of the Triton GEMV (ops/quant/gemv_triton.py)
        `matmul` runs for these rows x [M, K], or None where it runs another kernel."""
        return None

    def nbytes(self) -> int:
        raise NotImplementedError


class Int8Weight(QuantizedLinearWeight):
    gemv_kind = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        super().__init__(*qweight.shape, scales.dtype, qweight.device)
        self.qweight, self.scales = qweight, scales  # [N, K] int8, [N] in the activation dtype

        self.compute_scales = scales

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        super().set_compute_dtype(dtype)
        self.compute_scales = self.scales.to(dtype)

    def gemv_args(self, x: torch.Tensor) -> tuple | None:
        if x.is_cuda and x.shape[0] <= INT8_GEMV_MAX_ROWS and x.dtype != torch.float32:
            return self.qweight, self.compute_scales, {}
        return None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        args = self.gemv_args(x)
        if args is not None:
            from ops.quant.gemv_triton import gemv  # triton: imported on CUDA only

            return gemv(x, args[0], args[1], **args[2])
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.compute_scales)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.to(self.dtype) * self.scales[:, None]

    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


class Int4Weight(QuantizedLinearWeight):
    def __init__(self, packed, scales_and_zeros, group_size: int, shape, codes=None):
        super().__init__(*shape, scales_and_zeros.dtype, packed.device)
        self.packed, self.scales_and_zeros, self.group_size = packed, scales_and_zeros, group_size
        self.codes = codes  # [N, K] 0..15, kept only when asked (tests' oracle)
        self.compute_sz = scales_and_zeros

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        super().set_compute_dtype(dtype)
        self.compute_sz = self.scales_and_zeros.to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.packed, self.group_size, self.compute_sz
            )
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.compute_sz)

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


def quantize_int8(weight: torch.Tensor, reduce_amax=None) -> Int8Weight:
    """A dense [N, K] weight -> per-channel symmetric int8 (scales in the weight's dtype).

    reduce_amax: [N] row maxima of this part -> of the whole row (a row-parallel tensor-parallel
    shard holds K/n columns; its scales must be the full row's, as at one rank)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    if reduce_amax is not None:
        amax = reduce_amax(amax)
    scales = (amax / 127).clamp(min=1e-12)  # [N]
    q = torch.round(w / scales[:, None]).clamp_(-128, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.to(weight.dtype))


def int4_codes(weight: torch.Tensor, group_size: int):
    """[N, K] -> (codes [N, K] int32 in 0..15, scales [N, K/g], zeros [N, K/g]) in fp32."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    w_max, w_min = w.amax(dim=-1), w.amin(dim=-1)
    scales = ((w_max - w_min) / 15).clamp(min=1e-6)
    zeros = w_min + 8 * scales
    codes = torch.round((w - w_min[..., None]) / scales[..., None]).clamp_(0, 15)
    return codes.to(torch.int32).reshape(n, k), scales, zeros


def quantize_int4(
    weight: torch.Tensor, group_size: int = 32, keep_codes: bool = False
) -> Int4Weight:
    """A dense [N, K] weight -> group-wise asymmetric int4 in torch's packed layout."""
    n, k = weight.shape
    check_int4_shape(n, k, group_size)
    codes, scales, zeros = int4_codes(weight, group_size)
    return pack_int4(codes, scales, zeros, group_size, weight.dtype, keep_codes)


def pack_int4(
    codes, scales, zeros, group_size: int, dtype: torch.dtype, keep_codes=False
) -> Int4Weight:
    """Codes [N, K] (0..15) with scales / zeros [N, K/g] -> torch's packed int4 layout."""
    n, k = codes.shape
    check_int4_shape(n, k, group_size)
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
    codes = codes.to(torch.int32).contiguous()
    if codes.device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INT4_INNER_K_TILES)
    else:  # CUDA takes two codes per byte, the even column in the high nibble
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, INT4_INNER_K_TILES)
    return Int4Weight(packed, sz.to(dtype), group_size, (n, k), codes if keep_codes else None)


def dequantize_int4(codes, scales_and_zeros, group_size: int) -> torch.Tensor:
    """The oracle: (q - 8) * scale + zero per group, in fp32, [N, K]."""
    n, k = codes.shape
    scales, zeros = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [N, K/g] each
    grouped = (codes.float().reshape(n, k // group_size, group_size) - 8) * scales[..., None]
    return (grouped + zeros[..., None]).reshape(n, k)


def check_int4_shape(out_features: int, in_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"int4 group_size={group_size} is not supported; allowed values: {INT4_GROUP_SIZES}"
        )
    if in_features % group_size or out_features % 8:
        raise ValueError(
            f"int4 needs in_features divisible by group_size={group_size} and out_features by 8; "
            f"got a [{out_features}, {in_features}] weight"
        )


def quantize_weight(weight: torch.Tensor, mode: str, group_size: int = 32) -> QuantizedLinearWeight:
    """`mode` is "int8" or "int4"; anything else is an error listing the allowed values."""
    if mode == "int8":
        return quantize_int8(weight)
    if mode == "int4":
        return quantize_int4(weight, group_size)
    raise ValueError(f"quantization={mode!r} is not supported; allowed values: {', '.join(MODES)}")


@functools.cache
def fast_bf16_cpu() -> bool:
    """True when this CPU has native bf16 dot products (AVX512-BF16 or AMX), where the bf16
    kernels are the fast ones; probed through torch's own check."""
    mkldnn = getattr(torch.backends, "mkldnn", None)
    is_bf16_supported = getattr(
        getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None
    )
    if mkldnn is None or not mkldnn.is_available() or is_bf16_supported is None:
        return False
    return bool(is_bf16_supported())


def activation_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype quantized linears compute in for a `model_dtype` model (module doc's rule)."""
    # every CPU measured so far: on the AVX2-only EPYC too (no native bf16) the fp32-activation
    # kernels ran 6x (int8) / 12x (int4) the bf16 ones (docs/performance-log.md, 2026-12-03)
    if model_dtype == torch.float32 and torch.device(device).type == "cpu":
        return torch.bfloat16
    return model_dtype


@functools.cache
def can_run(mode: str, device_type: str, dtype: torch.dtype) -> str | None:
    """None when this torch build runs `mode` for `dtype` activations on `device_type`, else why not."""
    try:
        weight = torch.randn(64, 64, device=device_type).to(dtype)
        packed = quantize_weight(weight, mode)
        packed.linear(torch.randn(2, 64, device=device_type).to(dtype), None)
    except (RuntimeError, NotImplementedError) as exc:
        return str(exc).splitlines()[0][:200]
    return None
