"""Random GEMV weights for the kernel tests: an [n, k] weight of a kind with its per-channel
scale, drawn from the test's generator (the same draws in every file that uses it)."""

from __future__ import annotations

import torch


def random_weight(n: int, k: int, kind: str, gen: torch.Generator):
    """(w, scale) on CPU: bf16 (scale None), int8 in [-127, 127] with a bf16 scale, or e4m3 with
    an fp32 scale; the scales are powers of two spread over two octaves."""
    w = torch.randn(n, k, generator=gen)
    if kind == "bf16":
        return (w * 0.3).bfloat16(), None
    if kind == "int8":
        q = (w * 40).round().clamp(-127, 127).to(torch.int8)
        return q, (2 ** (torch.rand(n, generator=gen) * 2 - 6)).bfloat16()
    return w.to(torch.float8_e4m3fn), 2 ** (torch.rand(n, generator=gen) * 2 - 4)
