"""One-row GEMV on CUDA, the FMA loop against the tensor-core loop (ops/quant/gemv_triton.py
`_accumulate_dot`), as decode runs them: for each projection of the Llama-3.2-1B / 3.1-8B
geometries, a CUDA graph of the GEMV over distinct weights of one shape (>= 1 GiB together, or
128 copies) replayed, us per GEMV. fp8 (e4m3, per-channel scale) and bf16 weights; the FMA loop
at the table's tile (ops/quant/gemv_tiles.py) against a sweep of tensor-core tiles and Triton
num_stages, each checked against the fp32 product first; the fastest few re-timed in interleaved
rounds (median). Prints a table and, with --write-configs, the tiles as JSON: fp8 rows for
`tools/bench_cuda_decode.py --gemv-configs` (a 5th value 3 = READ_DOT, 6th = stages), bf16 ones
for TORCH_RUNNER_BF16_GEMV_CONFIGS.

Why: the FMA loop is bound by instruction issue (~4.6 sm_90 instructions a weight: e4m3 -> fp16,
fp16 -> fp32, FFMA, and a shared-memory transpose), not by HBM: the 8B fp8 step streamed its
GEMVs at 0.72 of the copy bandwidth (docs/performance-log.md, 2026-12-04).

    PYTHONPATH=. python tools/bench_gemv_dot.py --dtypes fp8,bf16 --write-configs /tmp/dot
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8_linear import SHAPES, copy_bandwidth, random_e4m3  # noqa: E402

# (BLOCK_N, BLOCK_K, num_warps, SPLIT_K): 16-32 channels on one or two warps (mma.sync),
# 64-128 on four or eight (a warpgroup: wgmma); splits for the narrow, long rows
DOT_SWEEP = [(16, 128, 1, 1), (16, 256, 1, 1), (16, 256, 2, 1), (16, 512, 2, 1),
             (32, 128, 1, 1), (32, 128, 2, 1), (32, 256, 2, 1), (32, 256, 4, 1),
             (64, 64, 4, 1), (64, 128, 4, 1), (64, 256, 4, 1), (128, 64, 4, 1),
             (128, 128, 4, 1), (128, 128, 8, 1),
             (16, 256, 1, 2), (32, 128, 2, 2), (32, 256, 2, 4), (64, 128, 4, 2),
             (64, 128, 4, 4),
             # the narrow shapes (8b qkv / o, 1b qkv / o / down: 256-384 programs of 16 channels
             # unsplit, too few bytes in flight a program): 4-8 way splits of 16-32 channels
             (16, 128, 1, 4), (16, 256, 1, 4), (16, 128, 1, 8), (32, 128, 2, 4),
             (32, 128, 2, 8)]  # fmt: skip
STAGES = (2, 4)


def _compile(jobs) -> int:
    """Build each (dtype, tile, stages) once on a small shape (every measured N, K and split is a
    multiple of 16, so the sweep then finds the same specialisation in Triton's disk cache)."""
    from ops.quant.gemv_triton import gemv

    for dtype, cfg, stages in jobs:
        n, k = 256, 16384
        w = torch.ones(n, k, device="cuda").to(
            torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
        )
        scale = torch.ones(n, device="cuda") if dtype == "fp8" else None
        gemv(torch.ones(1, k, device="cuda").bfloat16(), w, scale, cfg, dot=True, stages=stages)
    torch.cuda.synchronize()
    return len(jobs)


def precompile(dtypes, stages_list, workers: int) -> None:
    import multiprocessing

    jobs = list(itertools.product(dtypes, DOT_SWEEP, stages_list))
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        done = sum(pool.map(_compile, [jobs[i::workers] for i in range(workers)]))
    print(f"precompiled {done} kernels in {workers} processes", flush=True)


def weights_for(dtype: str, n: int, k: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    size = 1 if dtype == "fp8" else 2
    copies = max(2, min(128, -(-(1 << 30) // (n * k * size))))
    if dtype == "fp8":
        scale = torch.rand(n, device="cuda") * 1e-2 + 1e-3
        return [random_e4m3(n, k) for _ in range(copies)], scale
    return [torch.randn(n, k, device="cuda").bfloat16() * 0.02 for _ in range(copies)], None


def time_graph(calls, x, weights, scale, cfg, dot: bool, stages) -> float:
    from ops.quant.gemv_triton import gemv

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            gemv(x, w, scale, cfg, dot=dot, stages=stages)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * len(weights))


def run_shape(name: str, dtype: str, ceiling: float, sweep, stages_list) -> dict:
    from ops.quant.gemv_tiles import pick_bf16_config, pick_config
    from ops.quant.gemv_triton import gemv

    n, k = SHAPES[name]
    weights, scale = weights_for(dtype, n, k)
    x = torch.randn(1, k, device="cuda").bfloat16()
    w0 = weights[0].float() * (scale[:, None] if scale is not None else 1.0)
    want = x.float() @ w0.T
    table = pick_config(1, n, k) if dtype == "fp8" else pick_bf16_config(1, n, k)
    variants = {(table, False, None): None}
    for cfg, stages in itertools.product(sweep, stages_list):
        if cfg[1] > k or k % (cfg[3] * cfg[1]) or cfg[0] > n:
            continue
        variants[cfg, True, stages] = None
    times = {}
    for key in variants:
        cfg, dot, stages = key
        try:
            got = gemv(x, weights[0], scale, cfg, dot=dot, stages=stages)
        except Exception as e:  # a tile Triton cannot build (shared memory): skipped, said
            print(f"  {name} {dtype} {key}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        err = float((got.float() - want).norm() / want.norm())
        if not err < 5e-3:
            print(f"  {name} {dtype} {key}: wrong result (rel err {err:.3g}), skipped", flush=True)
            continue
        times[key] = time_graph(3, x, weights, scale, cfg, dot, stages)
    base = (table, False, None)
    again = sorted((c for c in times if c != base), key=times.get)[:4] + [base]
    rounds = {c: [times[c]] for c in again if c in times}
    for _ in range(3):
        for c in rounds:
            rounds[c].append(time_graph(5, x, weights, scale, *c))
    med = {c: sorted(t)[len(t) // 2] for c, t in rounds.items()}
    best = min((c for c in med if c != base), key=med.get, default=None)
    size = n * k * (1 if dtype == "fp8" else 2)
    row = dict(shape=name, dtype=dtype, n=n, k=k, copies=len(weights), table=list(table),
               fma_us=round(med.get(base, float("nan")), 2))  # fmt: skip
    if base in med:
        row["fma_frac"] = round(size / (med[base] / 1e6) / ceiling, 3)
    if best is not None:
        row.update(dot=[*best[0], best[2]], dot_us=round(med[best], 2),
                   dot_frac=round(size / (med[best] / 1e6) / ceiling, 3))  # fmt: skip
        row["speedup"] = round(med[base] / med[best], 3) if base in med else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", default="fp8,bf16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--stages", default=",".join(map(str, STAGES)))
    parser.add_argument("--write-configs", default="",
                        help="prefix: writes PREFIX_fp8.json and PREFIX_bf16.json")  # fmt: skip
    parser.add_argument("--json", default="", help="write every row here")
    parser.add_argument("--precompile", type=int, default=0, help="compile in N processes first")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    ceiling = copy_bandwidth()
    print(f"copy bandwidth {ceiling / 1e12:.2f} TB/s", flush=True)
    stages = [int(s) for s in args.stages.split(",")]
    if args.precompile:
        precompile(args.dtypes.split(","), stages, args.precompile)
    rows = []
    for dtype in args.dtypes.split(","):
        for name in args.shapes.split(","):
            row = run_shape(name, dtype, ceiling, DOT_SWEEP, stages)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\nshape dtype: FMA us (frac) | tensor-core us (frac) tile+stages | speedup")
    for r in rows:
        print(f"{r['shape']:12s} {r['dtype']:5s} {r['fma_us']:8.2f} ({r.get('fma_frac')}) | "
              f"{r.get('dot_us')} ({r.get('dot_frac')}) {r.get('dot')} | {r.get('speedup')}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.write_configs:
        write_configs(rows, args.write_configs)


def write_configs(rows, prefix: str) -> None:
    """The faster loop per shape: fp8 as set_configs rows, bf16 as read_bf16_configs' file."""
    from ops.quant.gemv_tiles import BF16_CONFIGS, CONFIGS, READ_DOT

    fp8 = {key: list(cfg) for key, cfg in CONFIGS.items()}
    bf16 = {key: list(cfg) for key, cfg in BF16_CONFIGS.items()}
    bf16_dot = {}
    for r in rows:
        key = (1, r["n"], r["k"])
        if not (r.get("speedup") or 0) > 1.0:
            continue
        *tile, stages = r["dot"]
        if r["dtype"] == "fp8":
            fp8[key] = [*tile, READ_DOT, stages]
        else:
            bf16[key] = tile
            bf16_dot[key] = stages
    Path(prefix + "_fp8.json").write_text(json.dumps([[list(k), v] for k, v in fp8.items()]))
    Path(prefix + "_bf16.json").write_text(json.dumps({
        "configs": [[list(k), v] for k, v in bf16.items()],
        "dot": [[list(k), s] for k, s in bf16_dot.items()]}))  # fmt: skip


if __name__ == "__main__":
    main()
