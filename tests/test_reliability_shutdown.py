"""SIGTERM drains: new requests get 503 and /health says draining, in-flight requests that can
finish within --shutdown-timeout do, the rest end with a final error event and [DONE] (a JSON
error when not streaming), their KV is freed, and the process exits 0. A busy port fails before
the model loads."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from serve_fixtures import MODEL_NAME, REPO_ROOT, ServerProcess, save_serve_checkpoint

COMPLETION = {"model": MODEL_NAME, "prompt": "Hi", "temperature": 0.0, "ignore_eos": True}
SHUTDOWN_TIMEOUT = 1.0
LONG = {"max_tokens": 2000, "n": 8}  # 16 rows of 2000 tokens: far longer than the timeout

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = save_serve_checkpoint(tmp_path_factory.mktemp("shutdown") / "tiny")
    return path


def test_sigterm_drains_then_ends_the_rest_and_exits_0(checkpoint):
    server = ServerProcess(checkpoint, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
    url = server.base_url

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:

            async def stream() -> list[str]:
                body = COMPLETION | LONG | {"stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    return [line async for line in r.aiter_lines() if line.startswith("data:")]

            long_stream = asyncio.create_task(stream())
            long_json = asyncio.create_task(client.post("/v1/completions", json=COMPLETION | LONG))
            await asyncio.sleep(0.5)
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            health = await client.get("/health")
            refused = await client.post("/v1/completions", json=COMPLETION | {"max_tokens": 2})
            return await long_stream, await long_json, health, refused

    try:
        long_lines, long_json, health, refused = asyncio.run(scenario())
        assert server.process.wait(timeout=60) == 0, server.output()
        log = server.output()
    finally:
        server.stop()
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_draining"
    assert long_lines[-1] == "data: [DONE]"
    final = json.loads(long_lines[-2][5:])
    assert final["error"]["code"] == "server_shutdown"
    assert len(long_lines) > 3  # it streamed tokens until the timeout ended it
    assert long_json.status_code == 503 and long_json.json()["error"]["code"] == "server_shutdown"
    assert "drained: 0 request(s) left, KV used 0 tokens" in log, log


def test_in_flight_request_finishes_during_the_drain(checkpoint):
    server = ServerProcess(checkpoint, "--shutdown-timeout", "30")
    try:
        with httpx.stream(
            "POST",
            f"{server.base_url}/v1/completions",
            json=COMPLETION | {"max_tokens": 64, "stream": True},
            timeout=60,
        ) as response:
            lines = response.iter_lines()
            first = next(lines)
            server.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert first.startswith("data:") and rest[-1] == "data: [DONE]"
        events = [json.loads(line[5:]) for line in rest[:-1]]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in event for event in events)
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()


def test_busy_port_fails_before_the_model_loads(checkpoint):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "torch_runner.serve", "--model", str(checkpoint),
             "--device", "cpu", "--port", str(port)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Loading" not in done.stderr and "KV pool" not in done.stderr
    assert time.monotonic() - start < 60
