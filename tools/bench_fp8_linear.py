"""One linear at decode shapes on CUDA: bf16 `F.linear` vs the fp8 paths (ops/quant/fp8.py:
`_scaled_mm` and the weight-only GEMV of ops/quant/gemv_triton.py) and int8 (the GEMV vs torch's
`_weight_int8pack_mm`), with a sweep of the GEMV's tiles. Prints, per projection shape of the
Llama-3.2-1B / 3.1-8B geometries and row count: us (median of `do_bench`, which clears the L2
before each call, so every weight comes from HBM as in a decode step), weight GB/s, the fraction
of the measured device-to-device copy bandwidth, and the ratio to bf16.

Why: at batch 1 the fp8 decode step was no faster than bf16 (docs/performance-log.md, 2026-12-01
23:20): this times the kernels alone, so the tile table and the GEMV-or-`_scaled_mm` choice in
ops/quant/gemv_tiles.py are measured, not guessed. --write-configs saves the best tiles as JSON;
tools/bench_cuda_decode.py --gemv-configs runs a model with them. Each row also times the best
tile with the 1-byte slices widened to fp16 as loaded (`widen`, gemv_triton.WIDEN_1BYTE), fp8
and int8, against the same tile carrying the raw bytes; at one row the fp8 sweep runs the e4m3
bit placement (`bits=True`) and each row also times the conversion path (`bits=False`)
at the table's tile, the kernel it replaces.

    PYTHONPATH=. python tools/bench_fp8_linear.py --rows 1,2,4,8 --write-configs /tmp/gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N, K) of the fused projections
    "1b qkv": (3072, 2048), "1b o": (2048, 2048), "1b gate_up": (16384, 2048),
    "1b down": (2048, 8192), "1b head": (128256, 2048),
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096),
    "8b down": (4096, 14336), "8b head": (128256, 4096),
}  # fmt: skip
# (BLOCK_N, BLOCK_K, num_warps, SPLIT_K): the full sweep at one row, a short one at more rows.
# Tiles that spill registers when compiled for sm_90 offline (16x1024 and 32-wide at 4 warps;
# the kernel holds two slices) are left out; splits go on the tiles with the most bytes in flight
SWEEP = [c for c in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (1,))
         if c[:3] != (16, 1024, 4)]  # fmt: skip
SWEEP += [(*t, s) for t in ((4, 512, 4), (8, 256, 4), (8, 512, 4), (4, 1024, 8)) for s in (2, 4, 8)]
# for the one-row e4m3 bit placement (x read per weight row): narrower and wider slices
SWEEP += [(2, 1024, 4, 1), (2, 2048, 8, 1), (4, 2048, 8, 1), (32, 256, 8, 1), (8, 256, 2, 1),
          (4, 512, 2, 1)]  # fmt: skip
# the chain (one row, in a graph): the winners there were small programs (2-4 warps, 2-8
# channels), so more of those (at most 64 weights a thread: more spill), splits for long rows
CHAIN_SWEEP = SWEEP + [(bn, bk, w, 1) for bn, bk, w in itertools.product(
    (1, 2, 4, 8, 16), (128, 256, 512, 1024, 2048), (1, 2, 4)) if 512 <= bn * bk <= 64 * 32 * w
    and (bn, bk, w, 1) not in SWEEP] + [(*t, s) for t in ((2, 1024, 4), (4, 512, 4), (8, 256, 2))
                                        for s in (2, 4)]  # fmt: skip
READS = {0: dict(bits=False, widen=True), 1: dict(bits=True), 2: dict(bits=False, widen=False)}
SHORT_SWEEP = [(*t, s) for t in ((4, 256, 4), (4, 512, 4), (8, 256, 4), (8, 512, 4),
                                 (16, 256, 4)) for s in (1, 4)]  # fmt: skip


def ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=25, return_mode="median")


def _compile(jobs) -> int:
    """Run the GEMV once per (rows, weight dtype, config, bits) on a shape every split divides:
    the kernels land in Triton's on-disk cache, where the sweep then finds them."""
    from ops.quant.gemv_triton import gemv

    for m, dtype, cfg, read in jobs:  # int8 scales are in the activation dtype, fp8's in fp32
        w = torch.ones(2048, 32768, device="cuda").to(dtype)
        scale = torch.ones(
            2048, device="cuda", dtype=torch.bfloat16 if dtype == torch.int8 else None
        )
        gemv(torch.ones(m, 32768, device="cuda").bfloat16(), w, scale, cfg, **READS[int(read)])
    torch.cuda.synchronize()
    return len(jobs)


def precompile(rows, workers: int, chain: bool = False) -> None:
    """Compile every sweep kernel in `workers` processes at once (one compile is ~1 s serially);
    chain: the one-row fp8 kernels, converting and by bit placement."""
    import multiprocessing

    if chain:
        jobs = [(1, torch.float8_e4m3fn, cfg, read) for cfg in CHAIN_SWEEP for read in READS]
    else:
        jobs = [(m, dtype, cfg, int(m == 1)) for m in rows for dtype in (torch.float8_e4m3fn, torch.int8)
                for cfg in (SWEEP if m == 1 else SHORT_SWEEP)]  # fmt: skip
    chunks = [jobs[i::workers] for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        done = sum(pool.map(_compile, chunks))
    print(f"precompiled {done} kernels in {workers} processes", flush=True)


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (the ceiling used)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / (ms(lambda: dst.copy_(src)) / 1e3)


def time_shape(name: str, m: int, n: int, k: int, sweep, ceiling: float) -> tuple[dict, tuple]:
    from ops.quant import fp8
    from ops.quant.gemv_tiles import block_rows, pick_config
    from ops.quant.gemv_triton import gemv
    from ops.quant.int_linear import quantize_int8

    w = torch.randn(n, k, device="cuda").bfloat16() * 0.02
    x = torch.randn(m, k, device="cuda").bfloat16()
    f8, i8 = fp8.quantize_fp8(w), quantize_int8(w)
    want = x.float() @ (f8.weight.float() * f8.scale[:, None]).T
    bf16 = ms(lambda: F.linear(x, w))
    limit, fp8.WEIGHT_ONLY_MAX_ROWS = fp8.WEIGHT_ONLY_MAX_ROWS, 0
    scaled = ms(lambda: f8.matmul(x))
    fp8.WEIGHT_ONLY_MAX_ROWS = limit
    results = []
    for cfg in sweep:
        if cfg[1] > k or (cfg[3] > 1 and k % (cfg[3] * cfg[1])):
            continue  # a split that does not divide K would run unsplit: timed already
        try:
            out = gemv(x, f8.weight, f8.scale, cfg, bits=True)
        except Exception as exc:  # a tile Triton cannot compile: skipped, and said
            print(f"  {name} M={m} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        err = float((out.float() - want).norm() / want.norm())
        if err < 5e-3:
            results.append((ms(lambda cfg=cfg: gemv(x, f8.weight, f8.scale, cfg, bits=True)), cfg))
    default_cfg = pick_config(m, n, k)
    default = ms(lambda: gemv(x, f8.weight, f8.scale, default_cfg, bits=True))
    best_t, best = min(results, default=(default, default_cfg))
    if default < best_t:
        best_t, best = default, default_cfg
    # the best tile again with each slice converted to fp16 as loaded (gemv_triton.WIDEN_1BYTE),
    # and the conversion path at the table's tile (one row: the sweep ran the bit placement)
    widen = [ms(lambda w=w: gemv(x, f8.weight, f8.scale, best, widen=w, bits=False))
             for w in (False, True)]  # fmt: skip
    converted = ms(lambda: gemv(x, f8.weight, f8.scale, default_cfg, bits=False))
    int8_gemv = ms(lambda: gemv(x, i8.qweight, i8.scales, best))
    int8_widen = ms(lambda: gemv(x, i8.qweight, i8.scales, best, widen=True))
    bf16_gemv = ms(lambda: gemv(x, w, None)) if m == 1 else None  # the bf16 table's tile
    int8_torch = None
    if m == 1:  # torch's kernel, for the ratio (slow: one row only)
        int8_torch = ms(lambda: torch.ops.aten._weight_int8pack_mm(x, i8.qweight, i8.scales)) * 1e3
    row = dict(shape=name, rows=m, n=n, k=k, bf16_us=round(bf16 * 1e3, 1),
               bf16_bw_frac=round(n * k * 2 / (bf16 / 1e3) / ceiling, 3),
               scaled_mm_us=round(scaled * 1e3, 1), gemv_default_us=round(default * 1e3, 1),
               gemv_best_us=round(best_t * 1e3, 1), gemv_best=list(best),
               gemv_bw_frac=round(n * k / (best_t / 1e3) / ceiling, 3),
               fp8_over_bf16=round(bf16 / min(best_t, scaled), 2),
               fp8_raw_us=round(widen[0] * 1e3, 1), fp8_widen_us=round(widen[1] * 1e3, 1),
               widen_speedup=round(widen[0] / widen[1], 3),
               fp8_converted_table_us=round(converted * 1e3, 1),
               int8_gemv_us=round(int8_gemv * 1e3, 1), int8_widen_us=round(int8_widen * 1e3, 1),
               int8_torch_us=int8_torch and round(int8_torch, 1),
               bf16_gemv_us=bf16_gemv and round(bf16_gemv * 1e3, 1))  # fmt: skip
    return row, ((block_rows(m), n, k), best)


def random_e4m3(n: int, k: int) -> torch.Tensor:
    """An [n, k] e4m3 weight of random non-NaN codes (uniform bytes, NaN bytes moved to 448)."""
    codes = torch.randint(0, 256, (n, k), device="cuda", dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] -= 1  # 0x7F / 0xFF (NaN) -> 0x7E / 0xFE (+-448)
    return codes.view(torch.float8_e4m3fn)


def time_chain(name: str, n: int, k: int, sweep, ceiling: float) -> tuple[dict, tuple]:
    """One row, as a decode step runs it: a CUDA graph of the GEMV over `copies` distinct
    weights of one shape (together past the L2 several times), replayed; us per GEMV for every
    tile and way to read e4m3 (READS: converted as loaded, bit placement, raw bytes), each
    checked against the fp32 product first."""
    from ops.quant.gemv_tiles import pick_config
    from ops.quant.gemv_triton import gemv

    copies = max(2, min(128, -(-(1 << 30) // (n * k))))
    weights = [random_e4m3(n, k) for _ in range(copies)]
    scale = torch.rand(n, device="cuda") * 1e-2 + 1e-3
    x = torch.randn(1, k, device="cuda").bfloat16()
    want = x.float() @ (weights[0].float() * scale[:, None]).T

    def time_graph(cfg, read) -> float:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in weights:
                gemv(x, w, scale, cfg, **READS[read])
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / (5 * copies)  # us per GEMV

    results = {}
    for cfg, read in itertools.product([pick_config(1, n, k), *sweep], READS):
        if (cfg, read) in results or cfg[1] > k or (cfg[3] > 1 and k % (cfg[3] * cfg[1])):
            continue
        out = gemv(x, weights[0], scale, cfg, **READS[read])  # compiled, split workspace made
        if float((out.float() - want).norm() / want.norm()) >= 5e-3:
            print(f"  {name} {cfg} read={read}: wrong result, skipped")
            continue
        results[cfg, read] = time_graph(cfg, read)
    # the 4 fastest and the table's tile again, 3 rounds interleaved: the median (one round
    # each picks noise among near-equal tiles)
    again = sorted(results, key=results.get)[:4] + [(pick_config(1, n, k), 0)]
    rounds = {c: [results[c]] for c in again}
    for _ in range(3):
        for c in again:
            rounds[c].append(time_graph(*c))
    results.update({c: sorted(t)[len(t) // 2] for c, t in rounds.items()})
    best = min(again, key=results.get)
    row = dict(shape=name, rows=1, n=n, k=k, copies=copies, table=list(pick_config(1, n, k)),
               table_us=round(results[pick_config(1, n, k), 0], 2))  # fmt: skip
    for read, label in ((0, "converted"), (1, "bits"), (2, "raw")):
        cfg = min((c for c, r in results if r == read), key=lambda c: results[c, read])
        row[label], row[label + "_us"] = list(cfg), round(results[cfg, read], 2)
    row["best"] = [*best[0], best[1]]
    row["best_bw_frac"] = round(n * k / (results[best] / 1e6) / ceiling, 3)
    return row, ((1, n, k), row["best"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--shapes", default="", help="comma list of SHAPES names ('' = all)")
    parser.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    parser.add_argument("--write-configs", default="", help="JSON file for the best tiles")
    parser.add_argument("--json", default="", help="JSON lines file for the rows")
    parser.add_argument("--precompile", type=int, default=0, help="compile in N processes first")
    parser.add_argument("--chain", action="store_true",
                        help="one row, fp8 only: time each tile in a CUDA graph of GEMVs over "
                        "distinct weights, converting and by bit placement (--write-configs "
                        "then holds [BLOCK_N, BLOCK_K, warps, split, bits])")  # fmt: skip
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.precompile and not args.no_sweep:
        precompile(rows, args.precompile, args.chain)
    ceiling = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {ceiling / 1e12:.2f} TB/s", flush=True)
    names = [s for s in args.shapes.split(",") if s] or list(SHAPES)
    if args.chain:
        return chain_main(names, [] if args.no_sweep else CHAIN_SWEEP, ceiling, args)
    table, lines = {}, []
    for m in rows:
        sweep = [] if args.no_sweep else SWEEP if m == 1 else SHORT_SWEEP
        for name in names:
            n, k = SHAPES[name]
            row, (key, best) = time_shape(name, m, n, k, sweep, ceiling)
            lines.append(row)
            table[key] = best
            print(json.dumps(row), flush=True)
        if args.write_configs:  # after each row count: a run cut short keeps what it measured
            with open(args.write_configs, "w") as f:
                json.dump([[list(key), list(cfg)] for key, cfg in table.items()], f)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines)
    print(
        "shape rows: bf16 us | _scaled_mm us | gemv us (best tile, HBM frac) | int8 gemv / torch us"
        " | fp8 raw / widened us (same tile, timed again) | converted at the table's tile"
    )
    for r in lines:
        print(f"{r['shape']:>11} {r['rows']}: {r['bf16_us']:7.1f} | {r['scaled_mm_us']:7.1f} | "
              f"{r['gemv_best_us']:7.1f} ({tuple(r['gemv_best'])}, {r['gemv_bw_frac']:.2f}) | "
              f"{r['int8_gemv_us']:7.1f} / {r['int8_torch_us'] or '-'} | "
              f"{r['fp8_raw_us']:7.1f} / {r['fp8_widen_us']:7.1f} | "
              f"{r['fp8_converted_table_us']:7.1f}")  # fmt: skip


def chain_main(names, sweep, ceiling: float, args) -> None:
    table, lines = {}, []
    for name in names:
        row, (key, best) = time_chain(name, *SHAPES[name], sweep, ceiling)
        lines.append(row)
        table[key] = best
        print(json.dumps(row), flush=True)
        if args.write_configs:
            with open(args.write_configs, "w") as f:
                json.dump([[list(k), list(cfg)] for k, cfg in table.items()], f)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines)
    print(
        "shape: us per GEMV in a graph chain | table tile converted | best converted | bits | raw"
    )
    for r in lines:
        print(f"{r['shape']:>11}: {r['table_us']:6.2f} {tuple(r['table'])} | "
              f"{r['converted_us']:6.2f} {tuple(r['converted'])} | {r['bits_us']:6.2f} "
              f"{tuple(r['bits'])} | {r['raw_us']:6.2f} {tuple(r['raw'])} | best {r['best']} at "
              f"{r['best_bw_frac']:.2f} of copy")  # fmt: skip


if __name__ == "__main__":
    main()
