"""The engine's batch-1 CPU decode with `cpu_compile` off (the flat decoder, default weight
packing) vs on (the runner's inductor-compiled, frozen step: torch_runner/runner/cpu_compiled.py;
weight_packing off, as the compiled step needs dense weights: it freezes and packs them itself),
both engines in one process, per mode.

For each dtype:quantization mode: compile + warm-up seconds of the compiled engine, whether the
two engines' 64 greedy tokens are equal, and decode tok/s (32-token prompt, --gen-len greedy
tokens after the first) medians over --rounds, the order flipping every round.

    PYTHONPATH=. .venv/bin/python tools/bench_cpu_compile_engine.py --modes float32:none,bfloat16:none
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PROMPT = list(range(100, 132))


def tok_s(engine, gen_len: int) -> float:
    from ops.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    engine.add_request(None, PROMPT, params)
    engine.step()  # prefill + first token
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - t0)


def bench_mode(dtype: str, quant: str, rounds: int, gen_len: int) -> None:
    from ops.sampling.params import SamplingParams
    from torch_runner import Engine

    kw = dict(device="cpu", dtype=dtype, quantization=quant, max_total_tokens=1024)
    engines = {
        "off": Engine(**kw, cpu_compile="off"),
        "on": Engine(**kw, cpu_compile="on", weight_packing="off"),
    }
    if engines["on"].runner.compiled_decode is None:
        raise SystemExit(f"{dtype}:{quant}: cpu_compile on did not give a compiled step")
    tok_s(engines["off"], 4)
    t0 = time.perf_counter()
    tok_s(engines["on"], 4)  # compiles at its first decode step
    compile_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=64, temperature=0.0)
    same = len({tuple(e.generate([PROMPT], params)[0].token_ids) for e in engines.values()}) == 1
    times: dict[str, list[float]] = {c: [] for c in engines}
    for r in range(rounds):
        for c in ("off", "on") if r % 2 == 0 else ("on", "off"):
            times[c].append(tok_s(engines[c], gen_len))
    cells = [f"{statistics.median(v):.1f} ({min(v):.0f}-{max(v):.0f})" for v in times.values()]
    ratio = statistics.median(times["on"]) / statistics.median(times["off"])
    print(f"| {dtype} / {quant} | {compile_s:.0f} | {same} | {' | '.join(cells)} | {ratio:.2f} |",
          flush=True)  # fmt: skip
    torch._dynamo.reset()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default="float32:none,bfloat16:none,bfloat16:int8,bfloat16:int4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, batch 1, {args.gen_len} tokens, "
          f"medians of {args.rounds} rounds, order flipping")  # fmt: skip
    print("| mode | compile + warm-up s | greedy 64 equal | flat tok/s | compiled tok/s | "
          "compiled / flat |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|")
    for mode in args.modes.split(","):
        bench_mode(*mode.split(":"), args.rounds, args.gen_len)


if __name__ == "__main__":
    main()
