"""Tensor parallel on 2 gloo ranks (CPU, fp32) against the same engine at tensor_parallel_size=1.

The oracle is the single-rank engine (itself pinned to transformers by the parity tests). Greedy
tokens must be identical; logprobs agree to LOGPROB_ATOL: a row-parallel matmul sums its two
halves after an all-reduce instead of in one dot product, so fp32 rounding differs by a few ulps
per layer (measured: at most ~2e-5 on these models), far below any greedy margin. gpt-oss runs
with its sinks split by head and both MoE families split within each expert.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
from engine_helpers import save_engine_checkpoint

from models.native_weights import weight_tensors
from ops.sampling.params import SamplingParams
from torch_runner.distributed.group import RankFailure
from torch_runner.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma3_text")
LOGPROB_ATOL = 1e-4
# a small pool (8 blocks of 16) so the batch below preempts; 16-token chunks split the prompts
ENGINE_KWARGS = dict(device="cpu", dtype="float32", max_total_tokens=128, chunked_prefill_size=16,
                     swa_kv="paged")  # fmt: skip


def tp_engine(path, monkeypatch, **kwargs) -> Engine:
    monkeypatch.delenv("MASTER_PORT", raising=False)  # rank 0 picks a free port
    return Engine(str(path), tensor_parallel_size=2, **{**ENGINE_KWARGS, **kwargs})


def workload(engine: Engine):
    """A batch that exercises chunked prefill, batching and preemption, then a prefix hit."""
    shared = [7, 3, 9, 4, 1, 8, 5, 6] * 5  # 40 tokens: 3 chunks of 16
    prompts = [shared + [11], [20, 21, 22], shared[:20] + [30, 31], [40] * 33]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True)
    first = engine.generate(prompts, params)
    again = engine.generate([shared + [12]], params)  # its first 32 tokens are cached blocks
    return first + again


def num_weights(engine: Engine) -> int:
    """Bytes held in weight memory: every distinct storage of the model's parameters, buffers
    and packed / tiled weights (the state dict alone misses the tiles, a tiled tied head
    replaces the embedding, and an fp32 head is two 16-bit planes; meta placeholders hold
    nothing)."""
    seen = {}
    for t in weight_tensors(engine.runner.model):
        if not t.is_meta:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def summary(outputs):
    tokens = [o.token_ids for o in outputs]
    logprobs = [[lp.logprob for lp in o.logprobs] for o in outputs]
    return tokens, logprobs, outputs[-1].num_cached_tokens


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path, _ = save_engine_checkpoint(
        request.param, tmp_path_factory.mktemp(request.param), initializer_range=0.5
    )
    return path


def test_two_ranks_match_one_rank(checkpoint, monkeypatch):
    single = Engine(str(checkpoint), **ENGINE_KWARGS)
    want_tokens, want_logprobs, want_cached = summary(workload(single))
    # (a model whose every layer is windowed gives back blocks behind the window: it fits, and
    # runs the workers over block tables with holes instead; kv/windows.py)
    assert single.stats()["num_preemptions"] > 0 or single.runner.layout.frees_behind_window, (
        "the pool must be small enough to preempt"
    )
    assert want_cached >= 32, "the last prompt must hit the prefix cache"
    engine = tp_engine(checkpoint, monkeypatch)
    try:
        tokens, logprobs, cached = summary(workload(engine))
        assert engine.stats()["num_preemptions"] == single.stats()["num_preemptions"]
        # the CPU flat decode loop runs under tp wherever it runs at one rank (llama here)
        assert (engine.runner.fast_decode is None) == (single.runner.fast_decode is None)
        # rank 0 holds half the weights (norms and the router are replicated: a few percent)
        share = num_weights(engine) / num_weights(single)
        assert 0.5 <= share < 0.56, share
    finally:
        engine.close()
    assert tokens == want_tokens
    assert cached == want_cached
    for got, want in zip(logprobs, want_logprobs):
        assert got == pytest.approx(want, abs=LOGPROB_ATOL)
    assert not multiprocessing.active_children(), "close() must stop the worker ranks"


def test_fewer_kv_heads_than_ranks_replicates_them(tmp_path, monkeypatch):
    path, _ = save_engine_checkpoint(
        "qwen3", tmp_path, initializer_range=0.5, num_key_value_heads=1
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, ignore_eos=True)
    prompts = [[5, 6, 7] * 7, [9, 8]]
    want = summary(Engine(str(path), **ENGINE_KWARGS).generate(prompts, params))
    engine = tp_engine(path, monkeypatch)
    try:
        got = summary(engine.generate(prompts, params))
    finally:
        engine.close()
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        assert a == pytest.approx(b, abs=LOGPROB_ATOL)


@pytest.mark.parametrize(
    ("overrides", "model_type", "message"),
    [
        (dict(tensor_parallel_size=0), "llama", "tensor_parallel_size=0 is invalid"),
        (dict(tensor_parallel_size=3), "llama", "must divide num_attention_heads (4)"),
        (dict(tensor_parallel_size=2, swa_kv="windowed"), "llama", "swa_kv='windowed'"),
    ],
)
def test_bad_combinations_fail_before_any_rank_starts(tmp_path, overrides, model_type, message):
    path, _ = save_engine_checkpoint(model_type, tmp_path)
    with pytest.raises(ValueError) as info:
        Engine(str(path), **{**ENGINE_KWARGS, **overrides})
    assert message in str(info.value)
    assert not multiprocessing.active_children()


def _one_step(engine):
    engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    return engine.step()


def test_a_dead_rank_fails_the_step_clearly(tmp_path, monkeypatch):
    path, _ = save_engine_checkpoint("llama", tmp_path)
    engine = tp_engine(path, monkeypatch)
    try:
        (worker,) = engine.tensor_parallel.processes
        worker.kill()
        worker.join(timeout=10)
        with pytest.raises(RankFailure, match="rank 1 exited"):
            _one_step(engine)
    finally:
        engine.close()


def test_a_hung_rank_times_out_instead_of_hanging(tmp_path, monkeypatch):
    path, _ = save_engine_checkpoint("llama", tmp_path)
    engine = tp_engine(path, monkeypatch, dist_timeout=3)
    (worker,) = engine.tensor_parallel.processes
    os.kill(worker.pid, signal.SIGSTOP)  # alive but not answering: only the timeout can tell
    try:
        start = time.monotonic()
        with pytest.raises(RankFailure):
            _one_step(engine)
        assert time.monotonic() - start < 30
        start = time.monotonic()
        engine.close()  # does not wait dist_timeout again for the hung rank: it is killed
        assert time.monotonic() - start < 8
        assert not worker.is_alive()
    finally:
        if worker.is_alive():
            worker.kill()
        engine.close()


def test_workers_exit_when_rank_0_is_killed(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    path, _ = save_engine_checkpoint("llama", tmp_path)
    script = (
        "import os\nfrom torch_runner.engine import Engine\n"
        f"e = Engine({str(path)!r}, device='cpu', dtype='float32', max_total_tokens=128, "
        "tensor_parallel_size=2)\n"
        "print(e.tensor_parallel.processes[0].pid, flush=True)\nos.kill(os.getpid(), 9)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=Path(__file__).parents[1], timeout=120)  # fmt: skip
    worker = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{worker}").exists(), "an orphaned rank must not outlive rank 0"


def test_more_ranks_than_cuda_devices_is_one_error(tmp_path, monkeypatch):
    import torch

    from torch_runner.config import EngineConfig
    from torch_runner.distributed import launch

    path, _ = save_engine_checkpoint("llama", tmp_path)
    monkeypatch.setattr(launch, "resolve_device", lambda spec: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("RANK", raising=False)
    config = EngineConfig(model=str(path), device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs 2 CUDA devices; 1 visible"):
        launch.check_launch(config, str(path))
