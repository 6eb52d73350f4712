"""A real `python -m torch_runner.serve` process on a free 127.0.0.1 port, over a tiny checkpoint.

The checkpoint is the tiny seeded Llama from tiny_models.py with the engine tests' byte-level
tokenizer (token id == byte value, so every logprob's `bytes` names its token id exactly) plus a
small ChatML-like chat template. Its context is widened so a long generation outlives a client
that disconnects.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from engine_helpers import byte_tokenizer
from tiny_models import build_tiny_model

API_KEY = "test-key"
MODEL_NAME = "tiny-llama"
MAX_POSITIONS = 2048
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
REPO_ROOT = Path(__file__).resolve().parents[1]


def save_serve_checkpoint(directory: Path, seed: int = 0):
    """Tiny Llama + byte tokenizer with a chat template; returns (path, HF reference model)."""
    model = build_tiny_model("llama", seed=seed, max_position_embeddings=MAX_POSITIONS)
    model.save_pretrained(directory)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory, model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python -m torch_runner.serve ...` in a subprocess, ready once /health answers."""

    def __init__(
        self,
        model_dir: Path | None,
        *extra_args: str,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        num_threads: int | None = 1,
        startup_timeout: float = 180.0,
    ):
        """`model_dir` None serves the embedded default model under its own name.

        One torch thread by default: on a shared, loaded CPU box a tiny model runs ~20x faster
        single-threaded than with intra-op threads contending for the cores.
        """
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = (log_dir or model_dir.parent) / f"server-{self.port}.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_RUNNER_")}
        if "TORCH_RUNNER_CACHE_DIR" in os.environ:
            full_env["TORCH_RUNNER_CACHE_DIR"] = os.environ["TORCH_RUNNER_CACHE_DIR"]
        if num_threads is not None:
            full_env["OMP_NUM_THREADS"] = str(num_threads)
        full_env.update(env or {})
        args = [
            sys.executable,
            "-m",
            "torch_runner.serve",
            "--device",
            "cpu",
            "--port",
            str(self.port),
        ]
        args += ["--log-level", "warning", *extra_args]
        if model_dir is not None:
            args += ["--model", str(model_dir), "--served-model-name", MODEL_NAME]
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            args, cwd=REPO_ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode}:\n{self.output()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def metric_values(base_url: str) -> dict[str, float]:
    """Unlabelled samples of /metrics (the engine gauges), parsed as Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.labels
    }


def wait_for_metrics(base_url: str, predicate, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    values = metric_values(base_url)
    while not predicate(values) and time.monotonic() < deadline:
        time.sleep(0.1)
        values = metric_values(base_url)
    return values


class ThreadedServer:
    """The same app on a real socket, served by uvicorn in a thread of the test process.

    Cheaper than a subprocess (torch and transformers are already imported), and still real
    HTTP: disconnects, chunked bodies and headers behave as in production.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        api_key: str | None = API_KEY,
        max_body_bytes: int = 8 << 20,
        max_choices: int = 128,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str = "auto",
        **engine_kwargs,
    ):
        import threading

        import torch
        import uvicorn

        from torch_runner import AsyncEngine, Engine
        from torch_runner.serve.app import create_app
        from torch_runner.serve.server import serving_state

        self._saved_threads = torch.get_num_threads()
        torch.set_num_threads(
            1
        )  # see ServerProcess: contention on a shared CPU box; restored in stop()
        self.engine = Engine(model=str(model_dir), device="cpu", **engine_kwargs)
        self.async_engine = AsyncEngine(self.engine)
        self.async_engine.start()
        state = serving_state(
            self.engine,
            self.async_engine,
            model_name=MODEL_NAME,
            api_key=api_key,
            max_body_bytes=max_body_bytes,
            max_choices=max_choices,
            chat_template=chat_template,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        )
        self.state = state
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(state), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        import torch

        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.async_engine.shutdown()
        torch.set_num_threads(self._saved_threads)
