"""GB/s of the CPU native linears (ops/cpu_native: torch.ops.torch_runner_native) at one row,
over distinct DRAM-resident copies of the default model's decode matrices (SmolLM2-135M: q/k/v
960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536), so every call streams its weight
from memory as a decode step does. fp32 / bf16 weights (dense_linear; fp32p / bf16p: their
tiling, dense_packed_linear), int8 codes (int8_linear; int8p: tiled) and int4 blocks
(int4_linear), both on q8 activation blocks; the AVX2 runtime uses the tiled kinds. One sweep
calls every copy once; median of --sweeps. --copies 1 (megabytes, cache-resident) against the
default (DRAM) tells a compute-bound kernel (the same rate) from a stream-bound one.

Why: a decode step's layers on a 2-core box are these kernels back to back; their streaming rate
against fp32's (which reaches the box's bandwidth) says whether a kernel or the memory bounds them.
A kernel change is compared by running this from each tree in alternation (the box drifts
10-20% over minutes: compare ratios within one alternation, never against an old figure).

    PYTHONPATH=. .venv/bin/python tools/bench_cpu_native_linear.py --kinds int8,bf16,fp32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ops.cpu_native.build import native_ops
from ops.cpu_native.reference import tile_rows

KINDS = ("int8", "int4", "bf16", "fp32", "bf16p", "fp32p", "int8p")
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def matrices(kind: str, copies: int, gen: torch.Generator) -> list[tuple]:
    mats = []
    for n, k in SHAPES:
        for _ in range(copies):
            if kind.startswith("int8"):
                codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
                if kind == "int8p":
                    codes = tile_rows(codes, 32)
                mats.append((codes, torch.rand(n, generator=gen) * 0.01, k))
            elif kind == "int4":  # qs [N, K / 32, 16] (two codes a byte), dm fp16 [N, 2, K / 32]
                qs = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=gen)
                dm = (torch.rand(n, 2, k // 32, generator=gen) * 0.01).half()
                mats.append((qs, dm, k))
            else:
                dtype = torch.bfloat16 if kind.startswith("bf16") else torch.float32
                w = torch.randn(n, k, generator=gen).to(dtype)
                mats.append((tile_rows(w) if kind.endswith("p") else w, k))
    return mats


def sweep(ops, kind: str, mats, xs) -> float:
    t0 = time.perf_counter()
    for m in mats:
        if kind.startswith("int8"):
            ops.int8_linear(xs[m[2]], m[0], m[1], m[2], None, None, False)
        elif kind == "int4":
            ops.int4_linear(xs[m[2]], m[0], m[1], None, None)
        elif kind.endswith("p"):
            ops.dense_packed_linear(xs[m[1]], m[0], None, None)
        else:
            ops.dense_linear(xs[m[1]], m[0], None, None)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--kinds",
        default="int8,bf16,fp32",
        help="comma list of int8, int4, bf16, fp32; bf16p / fp32p / int8p: tiled",
    )
    parser.add_argument("--copies", type=int, default=24, help="distinct matrices per shape")
    parser.add_argument("--sweeps", type=int, default=15)
    args = parser.parse_args()
    ops = native_ops()
    if ops is None:
        raise SystemExit("the native kernels did not build or this CPU has no AVX2 (see the log)")
    gen = torch.Generator().manual_seed(0)
    for kind in args.kinds.split(","):
        if kind not in KINDS:
            raise SystemExit(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
        mats = matrices(kind, args.copies, gen)
        x_dtype = torch.float32 if kind.startswith("fp32") else torch.bfloat16
        xs = {k: torch.randn(1, k, generator=gen).to(x_dtype) for _, k in SHAPES}
        size = sum(m[0].nbytes + (m[1].nbytes if kind == "int4" else 0) for m in mats)
        for _ in range(3):
            sweep(ops, kind, mats, xs)
        times = [sweep(ops, kind, mats, xs) for _ in range(args.sweeps)]
        med = statistics.median(times)
        print(f"{kind}: {size / 1e6:.0f} MB a sweep, median {med * 1e3:.2f} ms, "
              f"{size / med / 1e9:.1f} GB/s (best {size / min(times) / 1e9:.1f})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
