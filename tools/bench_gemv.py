"""One-row bf16 matmul (the batch-1 decode GEMV) at the Llama-3.2-1B / 3.1-8B projection shapes
on CUDA: cuBLAS (`F.linear`) against ops/quant/gemv_triton.py's GEMV with no scale, over a sweep
of its tiles, in one process. Both are timed the way a decode step runs them: `reps` calls
captured in one CUDA graph, each on the next of several copies of the weight (together past the
L2, so every call streams its weight from HBM), median of `rounds` replays, per call.

Prints one JSON row per shape (us and TB/s of weight bytes for cuBLAS, the rule's tile and the
best tile; the speed-up over cuBLAS) and, with --write-configs, the JSON table that
ops/quant/gemv_tiles.read_bf16_configs loads (TORCH_RUNNER_BF16_GEMV_CONFIGS=<file>): every
shape's best tile, and the shapes where the best tile was not at least --min-gain faster than
cuBLAS (auto mode keeps those on cuBLAS).

Before (2026-12-02, an earlier 4-tile kernel, H200): cuBLAS 1.4-2.4 TB/s on the 1B's small
matrices, ~4.2 on the heads; that kernel was 10-25% slower than cuBLAS at every shape.

    PYTHONPATH=. python tools/bench_gemv.py --dtype bf16 --shapes llama-1b,llama-8b \
        --precompile 14 --write-configs /tmp/bf16_gemv.json
    PYTHONPATH=.:/work/triton_site python tools/bench_gemv.py --offline  # no GPU: registers
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPE_SETS = {  # name -> {projection: (N, K)}; the engine fuses q/k/v and gate/up
    "llama-1b": {"1b qkv": (3072, 2048), "1b o": (2048, 2048), "1b gate_up": (16384, 2048),
                 "1b down": (2048, 8192), "1b head": (128256, 2048)},
    "llama-8b": {"8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096),
                 "8b down": (4096, 14336), "8b head": (128256, 4096)},
    "gpt-oss-20b": {"oss qkv": (5120, 2880), "oss o": (2880, 4096), "oss router": (32, 2880),
                    "oss head": (201088, 2880)},  # the bf16 parts of a gpt-oss-20b decode step
    "llama-1b-unfused": {"1b kv": (512, 2048), "1b gate": (8192, 2048)},
    "llama-8b-unfused": {"8b kv": (1024, 4096), "8b gate": (14336, 4096)},
}  # fmt: skip
# (BLOCK_N, BLOCK_K, num_warps, SPLIT_K): 8-64 weight elements per thread per slice (the loop
# holds two slices and an fp32 accumulator of one: 32-176 registers, no spills, compiled for
# sm_90 offline with Triton 3.6's ptxas), then split-K on tiles for the narrow shapes
SWEEP = [(bn, bk, w, 1) for bn in (1, 2, 4, 8, 16) for bk in (256, 512, 1024, 2048) for w in (4, 8)
         if 8 * 32 * w <= bn * bk <= 64 * 32 * w]  # fmt: skip
SWEEP += [(*t, s) for t in ((2, 1024, 4), (4, 512, 4), (4, 1024, 8), (8, 512, 8)) for s in (2, 4)]
DTYPES = {"bf16": torch.bfloat16}
WEIGHT_BYTES = 6e8  # weight copies per shape rotate through this many bytes (H200 L2: 50 MB)


def graph_time_us(fn, reps: int, rounds: int) -> float:
    """`reps` calls of fn captured in one CUDA graph; median of `rounds` replays, us per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles, allocates) outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps * 1e3)
    del graph
    return statistics.median(times)


def rotating(weights, call):
    """A closure calling `call(weight)` on the next of `weights` each time (captured in order)."""
    state = [0]

    def run():
        state[0] = (state[0] + 1) % len(weights)
        return call(weights[state[0]])

    return run


def _compile(jobs) -> int:
    """Run the GEMV once per (dtype, config) on a shape every split divides: the kernels land in
    Triton's on-disk cache, where the sweep finds them (all timed shapes divide by 16 alike)."""
    from ops.quant.gemv_triton import gemv

    for dtype, cfg in jobs:
        w = torch.ones(1024, 16384, device="cuda", dtype=dtype)
        gemv(torch.ones(1, 16384, device="cuda", dtype=dtype), w, None, cfg)
    torch.cuda.synchronize()
    return len(jobs)


def precompile(dtype: torch.dtype, workers: int) -> None:
    """Compile the sweep in `workers` processes at once (one compile is ~1 s serially)."""
    import multiprocessing

    jobs = [(dtype, cfg) for cfg in SWEEP]
    chunks = [jobs[i::workers] for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        done = sum(pool.map(_compile, chunks))
    print(f"precompiled {done} kernels in {workers} processes", flush=True)


def offline_registers(sweep) -> None:
    """Compile every tile for sm_90 here, no GPU needed (Triton's bundled ptxas, as
    tools/check_triton_compile.py does), and print its registers and spill bytes per thread:
    compile errors the interpreter misses, and tiles that would spill, show before a device call."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ops.quant.gemv_triton import _gemv

    names = ("x_ptr", "w_ptr", "s_ptr", "b_ptr", "out_ptr", "ws_ptr", "count_ptr", "N", "K",
             "k_split", "stride_xm", "stride_wn", "stride_om", "stride_sn")  # fmt: skip
    types = ["*bf16"] * 5 + ["*fp32", "*i32"] + ["i32"] * 7
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    for bn, bk, warps, split in sweep:
        for has_bias in (False, True):
            consts = dict(M=1, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, EVEN_K=True,
                          HAS_SCALE=False, SCALE_BN=0, SCALE_BK=0, HAS_BIAS=has_bias,
                          WIDEN=False)  # fmt: skip
            sig = dict(zip(names, types), **dict.fromkeys(consts, "constexpr"))
            aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(names) - 1)}
            src = ASTSource(fn=_gemv, signature=sig, constexprs=consts, attrs=aligned)
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": warps})  # fmt: skip
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True,
                                       text=True, check=True).stdout  # fmt: skip
            regs, spill = re.search(r"REG:(\d+).*LOCAL:(\d+)", usage).groups()
            print(json.dumps(dict(tile=[bn, bk, warps, split], bias=has_bias, registers=int(regs),
                                  local_bytes=int(spill))), flush=True)  # fmt: skip


def time_shape(name, n, k, dtype, sweep, reps, rounds) -> tuple[dict, tuple]:
    """One shape: cuBLAS, the rule's tile and every sweep tile (checked against fp32 first)."""
    from ops.quant.gemv_tiles import pick_bf16_config
    from ops.quant.gemv_triton import gemv

    copies = max(2, int(WEIGHT_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    want = x.float() @ weights[0].float().T
    cublas = graph_time_us(rotating(weights, lambda w: F.linear(x, w)), reps, rounds)
    rule = pick_bf16_config(1, n, k)
    timed = {}
    for cfg in dict.fromkeys([rule, *sweep]):
        if cfg[1] > k or (cfg[3] > 1 and k % (cfg[3] * cfg[1])):
            continue  # a slice wider than K, or a split that does not divide it (runs unsplit);
            # an unsplit tile whose slices do not divide K runs masked (gpt-oss: K = 2880)
        got = gemv(x, weights[0], None, cfg)
        err = float((got.float() - want).norm() / want.norm())
        if not err < 1e-2:
            raise RuntimeError(f"{name} tile {cfg}: relative error {err:.2e} against fp32")
        timed[cfg] = graph_time_us(rotating(weights, lambda w, c=cfg: gemv(x, w, None, c)),
                                   reps, rounds)  # fmt: skip
    best = min(timed, key=timed.get)
    gb = n * k * 2 / 1e9
    row = dict(shape=name, n=n, k=k, cublas_us=round(cublas, 2),
               cublas_tbs=round(gb / cublas * 1e3, 2), rule=list(rule),
               rule_us=round(timed[rule], 2) if rule in timed else None,
               best=list(best), best_us=round(timed[best], 2),
               best_tbs=round(gb / timed[best] * 1e3, 2),
               cublas_over_best=round(cublas / timed[best], 3), tiles_timed=len(timed))  # fmt: skip
    del weights
    torch.cuda.empty_cache()
    return row, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--shapes", default="llama-1b,llama-8b",
                        help=f"comma list of sets ({', '.join(SHAPE_SETS)}) or projection names")  # fmt: skip
    parser.add_argument("--no-sweep", action="store_true", help="time the rule's tiles only")
    parser.add_argument("--precompile", type=int, default=0, help="compile in N processes first")
    parser.add_argument("--reps", type=int, default=40, help="calls per captured graph")
    parser.add_argument("--rounds", type=int, default=5, help="timed replays (median)")
    parser.add_argument("--min-gain", type=float, default=0.02,
                        help="auto mode takes the GEMV only where it beat cuBLAS by this fraction")  # fmt: skip
    parser.add_argument("--write-configs", default="", help="JSON table for TORCH_RUNNER_BF16_GEMV_CONFIGS")  # fmt: skip
    parser.add_argument("--json", default="", help="JSON lines file for the rows")
    parser.add_argument("--offline", action="store_true",
                        help="no GPU: compile the sweep for sm_90, print registers and spills")  # fmt: skip
    args = parser.parse_args()
    if args.offline:
        return offline_registers(SWEEP)
    named = {p: nk for shapes in SHAPE_SETS.values() for p, nk in shapes.items()}
    shapes = {}
    for part in (s.strip() for s in args.shapes.split(",") if s.strip()):
        if part not in SHAPE_SETS and part not in named:
            raise SystemExit(f"--shapes: unknown {part!r}; sets: {', '.join(SHAPE_SETS)}; "
                             f"projections: {', '.join(named)}")  # fmt: skip
        shapes.update(SHAPE_SETS.get(part) or {part: named[part]})
    dtype = DTYPES[args.dtype]
    sweep = [] if args.no_sweep else SWEEP
    if args.precompile and sweep:
        precompile(dtype, args.precompile)
    print(
        f"{torch.cuda.get_device_name()}: {len(sweep)} tiles, torch {torch.__version__}", flush=True
    )
    rows, configs, cublas_faster = [], {}, []
    for name, (n, k) in shapes.items():
        row, best = time_shape(name, n, k, dtype, sweep, args.reps, args.rounds)
        rows.append(row)
        configs[1, n, k] = best
        if row["cublas_over_best"] < 1 + args.min_gain:
            cublas_faster.append([1, n, k])
        print(json.dumps(row), flush=True)
        if args.write_configs:  # after each shape: a run cut short keeps what it measured
            with open(args.write_configs, "w") as f:
                json.dump(dict(dtype=args.dtype, gpu=torch.cuda.get_device_name(),
                               configs=[[list(key), list(cfg)] for key, cfg in configs.items()],
                               cublas_faster=cublas_faster), f)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    # the same table as Python, for ops/quant/gemv_tiles.py
    print("BF16_CONFIGS = {" + ", ".join(f"{k}: {v}" for k, v in configs.items()) + "}")
    print("BF16_CUBLAS_FASTER = {" + ", ".join(str(tuple(k)) for k in cublas_faster) + "}")
    print("shape: cuBLAS us (TB/s) | rule tile us | best tile us (TB/s) | cuBLAS / best")
    for r in rows:
        print(f"{r['shape']:>12}: {r['cublas_us']:7.2f} ({r['cublas_tbs']:.2f}) | "
              f"{r['rule_us'] or float('nan'):7.2f} | {r['best_us']:7.2f} ({r['best_tbs']:.2f}) "
              f"{tuple(r['best'])} | {r['cublas_over_best']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
