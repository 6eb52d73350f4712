"""Read a kernel trace of decode steps (tools/bench_cuda_decode.py --profile-batch B --kernel-trace
PATH) offline: per step, the GPU busy and idle time, the kernels by name, and the kernels whose
name matches --match (the one-row GEMVs: every projection of a layer shares one Triton name) by
their position in the layer: the k-th match of a step goes to position k mod --per-layer, the
matches past layers * per-layer (the lm_head) to "tail". With --bytes, each position's weight
bytes (comma list, same order, then the tail's) turn its time into a fraction of --bandwidth.

    python tools/kernel_trace.py /tmp/out/k_llama-8b_fp8.b1.0.json --per-layer 4 \\
        --bytes 25165824,16777216,117440512,58720256,525336576
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def summarize(trace: dict, match: str, per_layer: int, layers: int = 0) -> dict:
    """Per-step means: busy / idle us, us by kernel name, us and count by GEMV position
    (layers 0: the matches per step // per_layer)."""
    kernels, steps = trace["kernels"], trace["steps"]
    busy = sum(dur for _, _, dur in kernels) / steps
    span = kernels[-1][1] + kernels[-1][2] - kernels[0][1] if kernels else 0.0
    by_name: dict[str, float] = defaultdict(float)
    for name, _, dur in kernels:
        by_name[name[:70]] += dur / steps
    hits = [dur for name, _, dur in kernels if match in name]
    per_step = len(hits) // steps if steps else 0
    layers = layers or per_step // per_layer
    positions: dict[str, list[float]] = defaultdict(list)
    for i, dur in enumerate(hits[: per_step * steps]):
        k = i % per_step
        key = str(k % per_layer) if k < layers * per_layer else "tail"
        positions[key].append(dur)
    return dict(busy_us=busy, span_us=span / steps, kernels_per_step=len(kernels) / steps,
                matches_per_step=per_step, by_name=dict(by_name),
                positions={k: (statistics.median(v), len(v) / steps) for k, v in positions.items()})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--match", default="gemv")
    parser.add_argument("--per-layer", type=int, default=4)
    parser.add_argument("--layers", type=int, default=0, help="0: matches // per-layer")
    parser.add_argument("--bytes", default="", help="weight bytes per position, then the tail's")
    parser.add_argument("--bandwidth", type=float, default=4.25e12)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    sizes = [int(b) for b in args.bytes.split(",") if b]
    for path in args.traces:
        s = summarize(json.loads(Path(path).read_text()), args.match, args.per_layer, args.layers)
        print(f"{path}: busy {s['busy_us']:.1f} us/step over a span of {s['span_us']:.1f}, "
              f"{s['kernels_per_step']:.0f} kernels, {s['matches_per_step']} '{args.match}'")  # fmt: skip
        gemv_total = 0.0
        for i, key in enumerate(sorted(s["positions"], key=lambda k: (k == "tail", k))):
            med, count = s["positions"][key]
            gemv_total += med * count
            frac = ""
            if i < len(sizes):
                frac = f" {sizes[i] / (med * 1e-6) / args.bandwidth:.2f} of copy"
            print(f"  position {key}: {med:.2f} us x {count:.0f}{frac}")
        print(f"  matched total {gemv_total:.1f} us/step, the rest {s['busy_us'] - gemv_total:.1f}")
        for name, us in sorted(s["by_name"].items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {us:9.1f} us  {name}")


if __name__ == "__main__":
    main()
