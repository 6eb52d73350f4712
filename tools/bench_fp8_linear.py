"""One linear at decode shapes on CUDA: bf16 `F.linear` vs the fp8 paths (ops/quant/fp8.py), with
a sweep of the Triton weight-only kernel's tiles. Prints ms (median of `do_bench`), GB/s of
weight bytes, and the ratio to bf16, for the Llama-3.2-1B / 3.1-8B projection shapes.

Why: at batch 1 the fp8 decode step was no faster than bf16 (docs/performance-log.md, 2026-12-01
23:20): this times the kernels alone, so the next tile choice is measured, not guessed.

    PYTHONPATH=. python tools/bench_fp8_linear.py --rows 1,4,16
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N, K) of the fused projections
    "1b qkv": (3072, 2048), "1b o": (2048, 2048), "1b gate_up": (16384, 2048),
    "1b down": (2048, 8192), "1b head": (128256, 2048),
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096),
    "8b down": (4096, 14336), "8b head": (128256, 4096),
}  # fmt: skip
SWEEP = list(itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 5)))


def time_shape(name: str, m: int, n: int, k: int, sweep: bool) -> str:
    from triton.testing import do_bench

    from ops.quant import fp8
    from ops.quant.fp8_triton import weight_only_matmul

    w = torch.randn(n, k, device="cuda").bfloat16() * 0.02
    x = torch.randn(m, k, device="cuda").bfloat16()
    packed = fp8.quantize_fp8(w)
    want = x.float() @ packed.dequantize().float().T

    def ms(fn) -> float:
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    bf16 = ms(lambda: F.linear(x, w))
    fp8.WEIGHT_ONLY_MAX_ROWS = 0
    scaled = ms(lambda: packed.matmul(x))
    row = [f"{name} M={m}: bf16 {bf16 * 1e3:.1f} us ({n * k * 2 / bf16 / 1e6:.0f} GB/s)",
           f"_scaled_mm {scaled * 1e3:.1f} us ({bf16 / scaled:.2f}x)"]  # fmt: skip
    best = None
    for cfg in [None, *SWEEP] if sweep else [None]:
        try:
            out = weight_only_matmul(x, packed.weight, packed.scale, cfg)
        except Exception as exc:  # a tile Triton cannot compile: skipped, and said
            row.append(f"{cfg}: {type(exc).__name__}")
            continue
        err = float((out.float() - want).norm() / want.norm())
        t = ms(lambda cfg=cfg: weight_only_matmul(x, packed.weight, packed.scale, cfg))
        if cfg is None:
            row.append(f"weight-only default {t * 1e3:.1f} us ({bf16 / t:.2f}x)")
        if err < 4e-3 and (best is None or t < best[0]):
            best = (t, cfg)
    if best is not None:
        t, cfg = best
        row.append(f"best {cfg} {t * 1e3:.1f} us ({n * k / t / 1e6:.0f} GB/s, {bf16 / t:.2f}x)")
    return "; ".join(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1")
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    for m in [int(r) for r in args.rows.split(",")]:
        for name, (n, k) in SHAPES.items():
            print(time_shape(name, m, n, k, not args.no_sweep), flush=True)


if __name__ == "__main__":
    main()
