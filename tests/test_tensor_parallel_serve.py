"""`python -m torch_runner.serve --tensor-parallel-size 2` (spawned ranks, and every rank started
by torchrun) answering the official openai client, against the offline single-rank Engine; and
a rank killed under the server: /health fails and the server exits 1 saying why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from serve_fixtures import REPO_ROOT, ServerProcess, free_port, save_serve_checkpoint

from torch_runner import Engine, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
LOGPROB_ATOL = 1e-4  # fp32 all-reduce rounding (see test_tensor_parallel.py)
FLAGS = ("--dtype", "float32", "--max-total-tokens", "2048")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_serve_checkpoint(tmp_path_factory.mktemp("serve_tp") / "tiny")[0]


@pytest.fixture(scope="module")
def expected(checkpoint):
    engine = Engine(str(checkpoint), device="cpu", dtype="float32", max_total_tokens=2048)
    ids = engine.tokenizer(PROMPT, add_special_tokens=False).input_ids
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True)
    out = engine.generate([ids], params)[0]
    return out.token_ids, [lp.logprob for lp in out.logprobs]


def _complete(base_url: str):
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    done = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                     max_tokens=10, temperature=0.0, logprobs=1,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    logprobs = done.choices[0].logprobs
    return list(logprobs.tokens), [float(v) for v in logprobs.token_logprobs]


def _check(base_url: str, expected, checkpoint) -> None:
    from engine_helpers import byte_tokenizer

    tokens, logprobs = _complete(base_url)
    want_ids, want_logprobs = expected
    assert "".join(tokens) == byte_tokenizer().decode(want_ids)
    assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ATOL)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_spawned_ranks_serve_the_openai_client_and_a_dead_rank_stops_the_server(
    checkpoint, expected
):
    from torch_runner.distributed.group import free_port

    server = ServerProcess(checkpoint, *FLAGS, "--tensor-parallel-size", "2",
                           env={"MASTER_PORT": str(free_port())})  # fmt: skip
    try:
        _check(server.base_url, expected, checkpoint)
        workers = [p for p in _children(server.process.pid)
                   if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]  # fmt: skip
        assert workers, "the server must have spawned a worker rank"
        os.kill(workers[-1], signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as failed:  # the request in flight: a 503
            _complete(server.base_url)
        assert failed.value.status_code == 503 and "rank 1 exited" in failed.value.message
        assert server.process.wait(timeout=60) == 1
        assert "tensor parallel rank 1 exited" in server.output()
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{server.base_url}/health", timeout=2)
    finally:
        server.stop()


def test_torchrun_ranks_serve_the_openai_client(checkpoint, expected, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_RUNNER_")}
    env["OMP_NUM_THREADS"] = "1"
    log = open(tmp_path / "torchrun.log", "w")  # noqa: SIM115 - closed below
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), "-m", "torch_runner.serve", "--device", "cpu",
            "--model", str(checkpoint), "--port", str(port), "-tp", "2", *FLAGS]  # fmt: skip
    process = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert process.poll() is None, (tmp_path / "torchrun.log").read_text()
        _check(base_url, expected, checkpoint)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
