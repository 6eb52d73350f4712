"""Host cost of one decode step, in microseconds per request (no model: sampled tokens are faked).

`--part request_state` (the default before the whole step was covered): B RequestStates with the
default model's tokenizer take one token per step, as EngineSteps._postprocess applies them
(append: stop checks + incremental detokenizer, then make_output).

`--part step`: the engine's whole host step, `EngineSteps.step` itself, over the real Scheduler,
BlockManager, RadixCache and RequestStates, with a stand-in runner whose `launch` does the host
part of a CUDA-graph decode step (placeholder rows, `cuda_graphs.fill_inputs`) and returns random
token ids as a `LaunchedStep`: schedule + advance + prefix publishing + input preparation +
postprocess, overlapped (as on CUDA) or synchronous. Steady window: every request decoding.
`--full-pool`: a long-running server's steady state. After the warm-up every free block holds a
cached prefix (chains of 8 blocks, only the prefix cache referencing them), so each block a
request grows into is first evicted from the prefix cache.

The step's device part is device-independent host code, so this CPU figure is the per-request
host cost a CUDA batch pays (the GPU table's b256 row is bounded by it). Process CPU time (all
threads: a tokenizer's worker threads count too) and wall time, median over steps.

    PYTHONPATH=. .venv/bin/python tools/bench_host_step.py --part step --batch 64,256 --steps 128
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from types import SimpleNamespace

import torch

from ops.sampling.params import SamplingParams
from torch_runner.engine import Engine
from torch_runner.engine_step import EngineSteps
from torch_runner.kv.block_manager import BlockManager
from torch_runner.kv.radix_cache import RadixCache
from torch_runner.request_state import RequestState
from torch_runner.runner.cuda_graphs import batch_buckets, fill_inputs, key_bucket
from torch_runner.runner.launched import LaunchedStep, placeholder
from torch_runner.scheduler import Scheduler
from torch_runner.sequence import Sequence

BLOCK_SIZE = 16
PROMPT_LEN = 128
STOPS = ["\n\n", "END"]  # --part request_state: random ids hit these now and then
STEP_STOPS = ["\n\n\n\n\n", "<END OF TEXT>"]  # --part step: never hit (the batch stays whole)


def _tokenizer():
    from transformers import AutoTokenizer

    from models.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def _prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(PROMPT_LEN)]


def run_request_state(tokenizer, batch: int, steps: int, stops: list[str] | None) -> dict:
    """Median over steps of (postprocess CPU time / batch), microseconds."""
    rng = random.Random(0)
    vocab = min(len(tokenizer), 49000)
    params = SamplingParams(max_tokens=steps, ignore_eos=True, stop=stops)
    states = []
    for i in range(batch):
        states.append(
            RequestState(Sequence(f"r{i}", _prompt(rng, vocab), params), tokenizer, {0}, 10**6)
        )
    tokens = [[rng.randrange(100, vocab) for _ in range(batch)] for _ in range(steps)]
    cpu, wall = [], []
    for step in range(steps):
        t0, w0 = time.process_time(), time.perf_counter()
        outputs = []
        for state, token in zip(states, tokens[step]):
            if state.seq.is_finished:
                continue
            finish = state.append(token, None, None)
            if finish is not None:
                state.seq.finish(*finish)
            outputs.append(state.make_output())
        cpu.append((time.process_time() - t0) / batch * 1e6)
        wall.append((time.perf_counter() - w0) / batch * 1e6)
    return {
        "cpu_us": statistics.median(cpu),
        "wall_us": statistics.median(wall),
        "min_cpu_us": min(cpu),
        "mean_cpu_us": statistics.fmean(cpu),  # what a whole run pays per step
    }


class _GraphStepRunner:
    """The host part of ModelRunner._launch_graph_step for a greedy decode batch; random ids."""

    layout = SimpleNamespace(has_swa=False, frees_behind_window=False)

    def __init__(self, vocab: int, max_bs: int, scratch_slot: int, seed: int = 0):
        self.rng = torch.Generator().manual_seed(seed)
        self.vocab, self.buckets, self.scratch_slot = vocab, batch_buckets(max_bs), scratch_slot
        self._rows: dict[str, int] = {}
        self.num_filled = 0

    def launch(self, chunks, grammar_rows=None) -> LaunchedStep:
        seqs = [c.seq for c in chunks]
        ids = torch.randint(100, self.vocab, (len(chunks),), generator=self.rng)
        if all(c.num_tokens == 1 for c in chunks):  # a decode step: the graph's inputs
            tokens = [
                placeholder(self._rows[c.seq.request_id])
                if c.is_chained
                else c.seq.token_slice(c.start, c.end)[0]
                for c in chunks
            ]
            rows = next(x for x in self.buckets if x >= len(chunks))
            num_keys = key_bucket(max(c.start for c in chunks) + 1, BLOCK_SIZE)
            fill_inputs(chunks, BLOCK_SIZE, rows, num_keys, self.scratch_slot, tokens)
            self.num_filled += 1
        self._rows = {s.request_id: i for i, s in enumerate(seqs)}
        return LaunchedStep(seqs, ids)

    def free(self, request_id: str) -> None:
        pass


class _HostEngine(EngineSteps):
    """EngineSteps over the real scheduler and request states; the runner is the stand-in."""

    _publish_prefixes = Engine._publish_prefixes
    _free_behind_window = Engine._free_behind_window
    _payload = Engine._payload

    def __init__(self, tokenizer, batch: int, overlapped: bool, stops):
        num_blocks = max(batch, 64) * (PROMPT_LEN + 4096) // BLOCK_SIZE
        self.config = SimpleNamespace(block_size=BLOCK_SIZE)
        self.block_manager = BlockManager(num_blocks, BLOCK_SIZE)
        self.prefix_cache = RadixCache(self.block_manager)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max(batch, 64),
                                   token_budget=PROMPT_LEN * max(batch, 64), prefix_cache=self.prefix_cache,
                                   max_model_len=10**6)  # fmt: skip
        vocab = min(len(tokenizer), 49000)
        self.runner = _GraphStepRunner(vocab, max(batch, 64), num_blocks * BLOCK_SIZE)
        self.tensor_parallel, self.is_overlapped, self._inflight = None, overlapped, None
        self.requests, self._grammar_masker = {}, None
        self.num_generated_tokens = self.num_non_finite = 0
        rng = random.Random(0)
        params = SamplingParams(max_tokens=10**5, ignore_eos=True, stop=stops)
        for i in range(batch):
            seq = Sequence(f"r{i}", _prompt(rng, vocab), params)
            self.scheduler.add(seq)
            self.requests[seq.request_id] = RequestState(seq, tokenizer, {0}, 10**6)


def fill_pool(engine: _HostEngine, chain: int = 8) -> int:
    """Cache a prefix in every free block (chains of `chain` blocks, the tree's reference only)."""
    rng, manager, cached = random.Random(1), engine.block_manager, 0
    while manager.num_free_blocks:
        blocks = [manager.allocate() for _ in range(min(chain, manager.num_free_blocks))]
        tokens = [rng.randrange(100, 49000) for _ in range(len(blocks) * BLOCK_SIZE)]
        engine.prefix_cache.insert(tokens, blocks)
        manager.release(blocks)
        cached += len(blocks)
    return cached


def run_step(
    tokenizer, batch: int, steps: int, stops, overlapped: bool, full_pool: bool = False
) -> dict:
    """Median over steady decode steps of (EngineSteps.step time / batch), microseconds."""
    engine = _HostEngine(tokenizer, batch, overlapped, stops)
    for _ in range(3):  # the prefill step and the first decode steps
        engine.step()
    if full_pool:
        fill_pool(engine)
    cpu, wall = [], []
    for _ in range(steps):
        t0, w0 = time.process_time(), time.perf_counter()
        outputs = engine.step()
        cpu.append((time.process_time() - t0) / batch * 1e6)
        wall.append((time.perf_counter() - w0) / batch * 1e6)
        if len(outputs) != batch:
            raise RuntimeError(f"{len(outputs)} outputs for a batch of {batch}: not steady")
    return {
        "cpu_us": statistics.median(cpu),
        "wall_us": statistics.median(wall),
        "min_cpu_us": min(cpu),
        "mean_cpu_us": statistics.fmean(cpu),  # block growths land on every 16th step
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("request_state", "step"), default="request_state")
    ap.add_argument("--batch", default="256", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sync", action="store_true", help="--part step: the synchronous engine")
    ap.add_argument(
        "--full-pool", action="store_true", help="--part step: cache in every free block"
    )
    args = ap.parse_args()
    tok = _tokenizer()
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        step_stops = STEP_STOPS if args.part == "step" else STOPS
        for name, stops in (("no_stops", None), ("stop_strings", step_stops)):
            runs = []
            for _ in range(args.repeats):
                if args.part == "step":
                    runs.append(
                        run_step(tok, batch, args.steps, stops, not args.sync, args.full_pool)
                    )
                else:
                    runs.append(run_request_state(tok, batch, args.steps, stops))
            rows.append({
                "part": args.part, "batch": batch, "stops": name, "full_pool": args.full_pool,
                "cpu_us_per_request_step": round(statistics.median(r["cpu_us"] for r in runs), 2),
                "wall_us_per_request_step": round(statistics.median(r["wall_us"] for r in runs), 2),
                "runs_cpu_us": [round(r["cpu_us"], 2) for r in runs],
                "min_cpu_us": round(min(r["min_cpu_us"] for r in runs), 2),  # the least-loaded step
                "mean_cpu_us": round(statistics.median(r["mean_cpu_us"] for r in runs), 2),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
