"""Where a CPU batch-1 decode step of the default model goes, per dtype / quantization.

Two views of the same steps (after a warm-up): a host-time split of `Engine.step` (the flat
decoder's layers, the lm_head, sampling, and the rest: scheduler, request state, tensors built
on the host), by wrapping those calls with perf_counter; and torch.profiler's op table
(self CPU time per aten/mkldnn op) for --profile-steps steps.

    PYTHONPATH=. .venv/bin/python tools/profile_cpu_decode.py --modes float32:none,bfloat16:int4
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch


def timed(store: dict, key: str, fn, counts=lambda out: True):
    """fn, timed into store[key] where counts(its output)."""

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        if counts(out):
            store[key].append(time.perf_counter() - t0)
        return out

    return wrapper


def profile_mode(dtype: str, quant: str, steps: int, profile_steps: int, top: int) -> None:
    import ops
    from ops.sampling.params import SamplingParams
    from torch_runner import Engine

    engine = Engine(dtype=dtype, quantization=quant, device="cpu", max_total_tokens=1024)
    runner = engine.runner
    times: dict = defaultdict(list)
    assert runner.fast_decode is not None, "the flat decode loop must be the decode path here"
    fast = runner.fast_decode
    runner.fast_decode = timed(times, "layers (flat decoder)", fast)
    runner.model.compute_logits = timed(times, "lm_head", runner.model.compute_logits)
    if hasattr(runner.model, "greedy_tokens"):  # an fp32 head's screened greedy pick (None: no)
        pick = runner.model.greedy_tokens
        runner.model.greedy_tokens = timed(times, "lm_head", pick, lambda out: out is not None)
    ops_sample = ops.sample
    ops.sample = timed(times, "sampler", ops_sample)
    prompt = list(range(100, 132))

    def run(n):
        engine.add_request(
            None, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        )
        engine.step()  # prefill
        for v in times.values():
            v.clear()
        total = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            total.append(time.perf_counter() - t0)
        return total

    run(16)
    total = run(steps)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    step = statistics.median(total) * 1e3
    rest = step - sum(med.values())
    print(
        f"\n## {dtype} / {quant}: step {step:.2f} ms ({1e3 / step:.1f} tok/s), median of {len(total)}"
    )
    for k, v in med.items():
        print(f"- {k}: {v:.2f} ms ({100 * v / step:.0f}%)")
    print(
        f"- rest of Engine.step (scheduler, request state, host tensors): {rest:.2f} ms ({100 * rest / step:.0f}%)"
    )
    from torch.profiler import ProfilerActivity, profile

    engine.add_request(
        None, prompt, SamplingParams(max_tokens=profile_steps + 1, temperature=0.0, ignore_eos=True)
    )
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished():
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    ops.sample = ops_sample


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--modes",
        default="float32:none,bfloat16:none,bfloat16:int8,float32:int8,bfloat16:int4,float32:int4",
    )
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for mode in args.modes.split(","):
        dtype, quant = mode.split(":")
        profile_mode(dtype, quant, args.steps, args.profile_steps, args.top)


if __name__ == "__main__":
    main()
