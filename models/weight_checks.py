"""Checks on checkpoint tensors before the model serves: dtype kind and finite values.

The loader already checks names and shapes (`check_weights`); these add what a broken or
mis-converted checkpoint gets wrong next. A float parameter must come from a floating-point
tensor (an int32 `q_proj.weight` would otherwise be assigned as is and fail deep in a matmul),
an integer or bool buffer from exactly its dtype, and every float tensor must be finite *after*
the cast to the serving dtype: a NaN in the file, or an fp32 value beyond fp16's range that the
cast turns into inf, would otherwise be served as garbage logits. Each error names the tensor.
"""

from __future__ import annotations

import torch

from models.errors import ModelLoadError

FLOAT_NAMES = "float32, bfloat16 or float16"
# elements per isfinite pass: on CPU isfinite's temporaries peak at 13-20 bytes an element (bf16:
# +213 MiB at 1 << 24, +79 at 1 << 22, measured), all of it on top of the weights being loaded
FINITE_CHUNK = 1 << 22


def check_dtype(name: str, tensor: torch.Tensor, expected: torch.dtype) -> None:
    """A float parameter needs a floating-point tensor; any other needs exactly its dtype."""
    if expected.is_floating_point:
        if not tensor.is_floating_point():
            raise ModelLoadError(
                f"tensor {name!r} has dtype {_name(tensor.dtype)}; expected a floating-point "
                f"tensor ({FLOAT_NAMES})"
            )
    elif tensor.dtype != expected:
        raise ModelLoadError(
            f"tensor {name!r} has dtype {_name(tensor.dtype)}; expected {_name(expected)}"
        )


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Every value finite (floating tensors only), counted in bounded chunks on the tensor's device."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    flat = tensor.reshape(-1)
    num_bad = 0
    for start in range(0, flat.numel(), FINITE_CHUNK):
        chunk = flat[start : start + FINITE_CHUNK]
        # one host sync per chunk: a load-time check, never on the serving path
        num_bad += int(chunk.numel() - torch.isfinite(chunk).sum().item())
    if num_bad:
        raise ModelLoadError(
            f"tensor {name!r} has {num_bad} non-finite value(s) (NaN or inf) as "
            f"{_name(tensor.dtype)}; the checkpoint is corrupt or overflows this dtype"
        )


def check_dtypes(expected: dict[str, torch.dtype], weights: dict[str, torch.Tensor]) -> None:
    """`check_dtype` for every expected tensor (names were checked already), before any copy."""
    for name, dtype in expected.items():
        check_dtype(name, weights[name], dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
