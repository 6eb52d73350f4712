"""Linear layers whose weight may be prepacked for the CPU's oneDNN matmul.

Why: decode multiplies a few rows by every weight matrix, so a CPU step is bound by how fast
the BLAS streams the weights. On the 2-core x86 box oneDNN's packed (blocked) weight format ran
the default model's matmuls 1.5x faster than MKL's dense `x @ W.T` at 1 row, 1.8-2.7x at 2-8,
1.3x at 64 and 1.05x at 512 rows, 2 threads (tools/bench_linear_packing.py,
docs/performance-log.md). A packed weight is an opaque
tensor of the same [out, in] shape; `linear` takes either kind, so models call one function.

The packed format depends on the CPU: bf16 / fp16 packing needs AVX512-BF16 / AVX-NE-CONVERT
class hardware, so `can_pack` probes the real op once per dtype instead of guessing.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ops.activation import silu_mul
from ops.fused import kernels_for
from ops.rope import rope_kv_write

PACK_ROWS_HINT = 8  # oneDNN picks the blocked layout for this many rows; 8 measured best for 1-512


@functools.cache
def can_pack(dtype: torch.dtype) -> bool:
    """True when this torch build and CPU can pack (and run) a `dtype` linear weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = pack_weight(torch.ones(8, 8, dtype=dtype))
        out = linear(torch.ones(2, 8, dtype=dtype), probe)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(out.shape == (2, 8) and torch.all(out == 8))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A CPU linear weight [out, in] -> the same matrix in oneDNN's packed format (opaque)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(
            f"pack_weight: expected a 2-D CPU weight [out, in]; got {tuple(weight.shape)} on "
            f"{weight.device.type}"
        )
    dense = weight.detach().contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(dense, PACK_ROWS_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [..., in] @ weight.T + bias -> [..., out], for a dense, a packed (`pack_weight`) or a
    weight-only int8 / int4 weight (ops/quant/int_linear.py)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if weight.is_quantized:  # QuantizedLinearWeight (plain tensors answer False)
        return weight.linear(x, bias)
    if x.is_cuda:
        return _linear_cuda(x, weight, bias)
    return F.linear(x, weight, bias)


# (dtypes, weight shape and strides, bias dtype) -> the bf16 GEMV and its tile, or None (cuBLAS):
# decided once per kind of one-row product, from the mode and table read once at start-up
_ONE_ROW_ROUTES: dict[tuple, tuple | None] = {}
_ONE_ROW_MODE: list[str] = []  # ops/quant/gemv_tiles.bf16_gemv_mode(), read on first use


def _linear_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """CUDA: a one-row product (batch-1 decode) through the Triton bf16 GEMV where the start-up
    switch and table route its shape (ops/quant/gemv_tiles.py: cuBLAS streamed the decode
    shapes well under the HBM rate), else cuBLAS; eager calls at bucketed row counts. The GEMV
    has no host sync and a fixed grid, so CUDA graphs capture it; graph and eager steps route
    a shape alike."""
    if x.numel() == x.shape[-1]:
        route = _route_for(x, weight, bias)
        if route is not None:
            gemv, config = route
            out = gemv(x.reshape(1, -1), weight, None, config, bias=bias)  # [1, N]
            return out.view(*x.shape[:-1], weight.shape[0])
    if not torch.cuda.is_current_stream_capturing():
        return _linear_eager_cuda(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`silu_mul(linear(x, weight, bias))` for a [gate | up] weight [2I, in] (a feed-forward's
    fused gate/up projection) -> [..., I]. On CUDA, where that product runs the Triton GEMV
    (batch-1 bf16 rows the table routes; fp8 / int8 decode rows) and the shape measured faster
    so (`TORCH_RUNNER_GEMV_SILU=auto`; `on`: every such product, `off`: none), the GEMV applies
    silu(gate) * up to its rounded sums before storing: one kernel and the [.., 2I] round trip
    fewer, the same values as the GEMV followed by the SiLU-mul kernel (so never with
    `TORCH_RUNNER_FUSED_KERNELS=0`, which keeps the torch SiLU-mul)."""
    if _silu_mode() != "off" and kernels_for(x) is not None:  # the fused SiLU-mul's values
        out = _gated_gemv(x, weight, bias)
        if out is not None:
            return out
    return silu_mul(linear(x, weight, bias))


_SILU_MODE: list[str] = []  # ops/quant/gemv_tiles.silu_gemv_mode(), read on first use


def _silu_mode() -> str:
    if not _SILU_MODE:
        from ops.quant.gemv_tiles import silu_gemv_mode

        _SILU_MODE.append(silu_gemv_mode())
    return _SILU_MODE[0]


def _gated_gemv(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The GEMV `linear` would run for x @ weight.T, in its gated mode; None where `linear`
    runs another kernel or the mode does not fuse this shape (ops/quant/gemv_tiles.silu_in_gemv)."""
    from ops.quant.gemv_tiles import silu_in_gemv

    mode = _silu_mode()
    return _epilogue_gemv(x, weight, bias, lambda kind, m, n, k: silu_in_gemv(kind, m, n, k, mode),
                          gated=True)  # fmt: skip


def _epilogue_gemv(x: torch.Tensor, weight, bias: torch.Tensor | None, takes, **epilogue):
    """The GEMV `linear` would run for x @ weight.T, with `epilogue` (gemv's gated / rope
    argument); None where `linear` runs another kernel (or adds a quantized weight's bias after
    rounding: not fused) or `takes(kind, rows, n, k)` says no for this weight kind and shape."""
    flat = x.reshape(-1, x.shape[-1])
    if getattr(weight, "is_quantized", False):
        kind, same_dtype = weight.gemv_kind, weight.compute_dtype == flat.dtype
        if kind is None or bias is not None or not same_dtype:
            return None
        if not takes(kind, flat.shape[0], *weight.shape):
            return None  # the shape table first: gemv_args is the costlier question
        args = weight.gemv_args(flat)
        if args is None:
            return None
        from ops.quant.gemv_triton import gemv

        out = gemv(flat, args[0], args[1], **args[2], **epilogue)
    else:
        fuse = flat.shape[0] == 1 and takes("bf16", 1, *weight.shape)
        route = _route_for(flat, weight, bias) if fuse else None
        if route is None:
            return None
        gemv, config = route
        out = gemv(flat, weight, None, config, bias=bias, **epilogue)
    return out.view(*x.shape[:-1], out.shape[-1])


def linear_rope_kv(x: torch.Tensor, weight, bias, cos, signed_sin, k_pool, v_pool, slots,
                   num_q_heads: int) -> torch.Tensor:  # fmt: skip
    """A decode q/k/v projection and what follows it: x [T, in] (one token a row) @ a
    [q | k | v] weight -> rope on q and k by the rows cos / signed_sin [T, D_rot], k and v
    written to k_pool / v_pool [slots, Hkv, D] at `slots` [T]; returns q [T, Hq, D]. On CUDA,
    where the product runs the Triton GEMV (`TORCH_RUNNER_GEMV_ROPE`, default on; full-rotary heads,
    bf16 / fp16), the GEMV does all of it in its epilogue (one kernel, not two; the same values);
    otherwise `linear`, then ops.rope.rope_kv_write."""
    t, d = x.shape[0], k_pool.shape[-1]
    full = cos.shape[-1] == d and x.dtype in (torch.bfloat16, torch.float16)
    if full and _rope_mode() == "on" and kernels_for(x) is not None:
        from ops.quant.gemv_epilogue import RopeKvTarget
        from ops.quant.gemv_tiles import MAX_ROWS

        target = RopeKvTarget(cos, signed_sin, slots, k_pool, v_pool, num_q_heads)
        if target.is_dense():
            q = _epilogue_gemv(x, weight, bias, lambda kind, m, n, k: m <= MAX_ROWS, rope=target)
            if q is not None:
                return q.view(t, num_q_heads, d)
    qkv = linear(x, weight, bias).view(t, -1, d)  # [T, Hq + 2 Hkv, D]
    return rope_kv_write(qkv, cos, signed_sin, k_pool, v_pool, slots, num_q_heads)


_ROPE_MODE: list[str] = []  # ops/quant/gemv_tiles.rope_gemv_mode(), read on first use


def _rope_mode() -> str:
    if not _ROPE_MODE:
        from ops.quant.gemv_tiles import rope_gemv_mode

        _ROPE_MODE.append(rope_gemv_mode())
    return _ROPE_MODE[0]


def _route_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The one-row bf16 GEMV route of x [1, K] @ weight.T (decided once per kind), or None."""
    if weight.is_mkldnn:
        return None
    bias_kind = None if bias is None else (bias.dtype, bias.stride(0))
    key = (x.dtype, weight.dtype, *weight.shape, *weight.stride(), bias_kind)
    route = _ONE_ROW_ROUTES.get(key, False)
    if route is False:
        route = _ONE_ROW_ROUTES[key] = _one_row_route(x, weight, bias)
    return route


def _one_row_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """(gemv, tile) when a one-row product of this kind takes the bf16 GEMV, else None: bf16
    activations, weight and bias, a row-major 2-D weight, and the mode / table say so."""
    from ops.quant.gemv_tiles import bf16_gemv_mode, bf16_takes_gemv, pick_bf16_config

    if not _ONE_ROW_MODE:
        _ONE_ROW_MODE.append(bf16_gemv_mode())
    is_plain = x.dtype == weight.dtype == torch.bfloat16 and weight.dim() == 2
    is_plain = is_plain and weight.stride(-1) == 1  # rows K-contiguous: the kernel's loads
    if bias is not None:
        is_plain = is_plain and bias.dtype == x.dtype and bias.stride(0) == 1
    if not is_plain or not bf16_takes_gemv(1, *weight.shape, _ONE_ROW_MODE[0]):
        return None
    from ops.quant.gemv_triton import gemv

    return gemv, pick_bf16_config(1, *weight.shape)


EAGER_ROW_BUCKET = 64  # eager CUDA matmuls of more than MIN_PADDED_ROWS rows round M up to this
MIN_PADDED_ROWS = 16


def _linear_eager_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Eager CUDA `x @ weight.T + bias` at a bucketed row count, the bias through cuBLAS's plain
    GEMM (beta = 1 over the bias broadcast to [M, out]: the same single rounding as the fused
    epilogue).

    Why: cuBLAS chooses an algorithm per (M, N, K) and caches it; the first matmul at a new M
    (a prefill chunk of a length never seen) paid that choice, so a new length cost 1.03-1.9x
    a repeat on an H200 (tools/bench_cuda_decode.py --new-lengths). Padding M to a multiple of
    EAGER_ROW_BUCKET (zero rows, sliced off) makes every chunk length one of a few shapes. With a
    1-D bias `F.linear` takes cuBLASLt's bias epilogue, whose heuristic torch queries at every
    call (136-383 us of host time per matmul); a 2-D broadcast bias keeps addmm off that path.
    Graph capture keeps `F.linear`: its host cost is paid once, at capture.
    """
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    rows = x2.shape[0]
    padded = rows
    if rows > MIN_PADDED_ROWS:
        padded = -(-rows // EAGER_ROW_BUCKET) * EAGER_ROW_BUCKET
        if padded != rows:
            x2 = F.pad(x2, (0, 0, 0, padded - rows))  # [M', in], zero rows
    if bias is None:
        out = torch.mm(x2, weight.t())
    else:
        out = torch.addmm(bias.expand(padded, -1), x2, weight.t())  # [M', out]
    return out[:rows].view(*x.shape[:-1], weight.shape[0])


def linear_add(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """`linear(x, weight, bias) + residual` (same shape as the output). A packed weight adds the
    residual inside the matmul (oneDNN binary post-op, bit-identical: the fp32 result is
    rounded once either way), which saves a pass and a kernel call per residual branch."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")
    if weight.is_quantized:  # the native CPU weights add it inside their kernel (ops/cpu_native)
        return weight.linear_add(x, bias, residual)
    return F.linear(x, weight, bias).add_(residual)
