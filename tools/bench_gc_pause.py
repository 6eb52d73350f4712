"""Stop-the-world pause of a full (generation-2) garbage collection in a serving-like process,
before and after `freeze_startup_heap` (torch_runner/gc_heap.py; the server calls it after its
warm-up). Loads an Engine, runs one batch of requests (--batch x --gen-len greedy tokens), then
times `gc.collect()` --repeats times (median, ms) with the start-up heap walked and frozen, and
counts the collections of each generation during a second batch (gc.callbacks) with their longest
pause.

    PYTHONPATH=. .venv/bin/python tools/bench_gc_pause.py            # the default model on CPU
    PYTHONPATH=. python3 tools/bench_gc_pause.py --device cuda --model PATH
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch

from ops.sampling.params import SamplingParams
from torch_runner import Engine
from torch_runner.gc_heap import freeze_startup_heap


def run_batch(engine: Engine, batch: int, gen_len: int, seed: int) -> None:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(None, [rng.randrange(100, 20000) for _ in range(64)], params)
    while engine.has_unfinished():
        engine.step()


def full_collection_ms(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def collections_during(engine: Engine, batch: int, gen_len: int) -> dict:
    """Collections per generation during one batch, and the longest pause of each (ms)."""
    started, pauses = [0.0], {}

    def probe(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.setdefault(info["generation"], []).append(time.perf_counter() - started[0])

    gc.callbacks.append(probe)
    try:
        run_batch(engine, batch, gen_len, seed=1)
    finally:
        gc.callbacks.remove(probe)
    return {f"gen{g}": [len(p), round(max(p) * 1e3, 2)] for g, p in sorted(pauses.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.model is None:
        from models.default_model import default_model_path

        args.model = str(default_model_path())
    engine = Engine(args.model, device=args.device, max_total_tokens=args.batch * 128 + 256)
    run_batch(engine, args.batch, args.gen_len, seed=0)  # warm-up, as the server's
    walked = dict(
        tracked=len(gc.get_objects()), full_collection_ms=full_collection_ms(args.repeats)
    )
    walked["collections"] = collections_during(engine, args.batch, args.gen_len)
    frozen_count = freeze_startup_heap()
    frozen = dict(frozen=frozen_count, tracked=len(gc.get_objects()),
                  full_collection_ms=full_collection_ms(args.repeats))  # fmt: skip
    frozen["collections"] = collections_during(engine, args.batch, args.gen_len)
    for row in (walked, frozen):
        row["full_collection_ms"] = round(row["full_collection_ms"], 2)
    print(json.dumps(dict(device=args.device, walked=walked, after_freeze=frozen)), flush=True)


if __name__ == "__main__":
    main()
