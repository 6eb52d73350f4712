"""What the run-time non-finite-logits check costs per decode step, against the argmax it sits
beside: the fp32 row sum the runner uses, and `isfinite().all()` (a [B, V] bool temporary).

    .venv/bin/python tools/bench_nonfinite_check.py --vocab 49152 --batch 1 8 64 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

CHECKS = {
    "argmax (reference)": lambda x: x.max(dim=-1).indices,
    "isfinite(sum fp32) (used)": lambda x: torch.isfinite(x.sum(dim=-1, dtype=torch.float32)),
    "isfinite().all()": lambda x: torch.isfinite(x).all(dim=-1),
}


def time_us(fn, x, iters: int) -> float:
    fn(x)
    start = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=5, help="Rounds; medians reported.")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"vocab {args.vocab}, {args.threads} thread(s), medians of {args.repeats} rounds (us)")
    print("| dtype | batch | " + " | ".join(CHECKS) + " | used / argmax |")
    print("|---|---|" + "---|" * (len(CHECKS) + 1))
    for dtype in (torch.float32, torch.bfloat16):
        for batch in args.batch:
            x = torch.randn(batch, args.vocab).to(dtype)
            rounds = {name: [] for name in CHECKS}
            for _ in range(args.repeats):  # interleaved: drift hits every check alike
                for name, fn in CHECKS.items():
                    rounds[name].append(time_us(fn, x, args.iters))
            med = {name: statistics.median(v) for name, v in rounds.items()}
            ratio = med["isfinite(sum fp32) (used)"] / med["argmax (reference)"]
            cells = " | ".join(f"{med[name]:.0f}" for name in CHECKS)
            print(f"| {str(dtype).removeprefix('torch.')} | {batch} | {cells} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
