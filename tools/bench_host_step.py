"""Host cost of one decode step's postprocessing, in microseconds per request (no model).

B RequestStates with the default model's tokenizer take one token per step, as
EngineSteps._postprocess applies them (append: stop checks + incremental detokenizer, then
make_output). The step's device part is device-independent host code, so this CPU figure is
the per-request host cost a CUDA batch pays (the GPU table's b256 row is bounded by it).

    PYTHONPATH=. .venv/bin/python tools/bench_host_step.py --batch 256 --steps 128
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from ops.sampling.params import SamplingParams
from torch_runner.request_state import RequestState
from torch_runner.sequence import Sequence


def _tokenizer():
    from transformers import AutoTokenizer

    from models.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def run(tokenizer, batch: int, steps: int, stops: list[str] | None) -> float:
    """Median over steps of (postprocess CPU time / batch), microseconds."""
    rng = random.Random(0)
    vocab = min(len(tokenizer), 49000)
    params = SamplingParams(max_tokens=steps, ignore_eos=True, stop=stops)
    states = []
    for i in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(128)]
        states.append(RequestState(Sequence(f"r{i}", prompt, params), tokenizer, {0}, 10**6))
    tokens = [[rng.randrange(100, vocab) for _ in range(batch)] for _ in range(steps)]
    per_step = []
    for step in range(steps):
        t0 = time.thread_time()  # CPU time of this thread: the box's other jobs do not count
        outputs = []
        for state, token in zip(states, tokens[step]):
            if state.seq.is_finished:
                continue
            finish = state.append(token, None, None)
            if finish is not None:
                state.seq.finish(*finish)
            outputs.append(state.make_output())
        per_step.append((time.thread_time() - t0) / batch * 1e6)
    return statistics.median(per_step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tok = _tokenizer()
    result = {}
    for name, stops in (("no_stops", None), ("stop_strings", ["\n\n", "END"])):
        runs = [run(tok, args.batch, args.steps, stops) for _ in range(args.repeats)]
        result[name] = {"us_per_request_step": round(statistics.median(runs), 2)}
    print(json.dumps({"batch": args.batch, "steps": args.steps, **result}))


if __name__ == "__main__":
    main()
