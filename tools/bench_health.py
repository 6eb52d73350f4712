"""Does one client stall the others? /health latency while near-limit bodies are processed.

Starts `python -m torch_runner.serve` (one server per checkout given with --repo, so the code
before and after a change run side by side in one invocation, interleaved round by round),
then, per round, sends --bodies concurrent chat requests whose content fills the body limit
(each is tokenized, templated and answered 400 context_length_exceeded: the work is the
tokenization) while a probe GETs /health every --probe-ms. It also streams one small completion
meanwhile and reports the largest gap between its tokens. Reports per checkout the median over
rounds of the probe's p50 / p99 / max latency and the stream's largest gap.

    .venv/bin/python tools/bench_health.py --repo . --repo /work/main --bodies 3 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

BODY_BYTES = 7 * 1024 * 1024  # below the default 8 MiB limit


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repo", action="append", default=None, help="Checkout to serve from.")
    parser.add_argument("--model", default=None, help="Model folder (default: embedded model).")
    parser.add_argument("--bodies", type=int, default=3, help="Concurrent near-limit bodies.")
    parser.add_argument("--body-bytes", type=int, default=BODY_BYTES, help="Bytes per body.")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds per checkout.")
    parser.add_argument("--probe-ms", type=float, default=20.0, help="/health probe interval.")
    parser.add_argument("--port", type=int, default=18650, help="First port to use.")
    return parser.parse_args()


def start_server(repo: Path, port: int, model: str | None) -> subprocess.Popen:
    args = [sys.executable, "-m", "torch_runner.serve", "--device", "cpu", "--port", str(port)]
    args += ["--log-level", "warning"] + (["--model", model] if model else [])
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server from {repo} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server from {repo} did not start")


async def probe(client: httpx.AsyncClient, url: str, interval: float, stop: asyncio.Event):
    latencies = []
    while not stop.is_set():
        start = time.perf_counter()
        await client.get(f"{url}/health", timeout=60)
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(interval)
    return latencies


async def stream_gaps(client: httpx.AsyncClient, url: str, stop: asyncio.Event) -> float:
    """Largest gap between SSE events of small streams, kept running until `stop`."""
    worst = 0.0
    body = {"prompt": "Once upon a time", "max_tokens": 32, "stream": True, "ignore_eos": True}
    while not stop.is_set():
        last = time.perf_counter()
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    now = time.perf_counter()
                    worst = max(worst, now - last)
                    last = now
    return worst


async def one_round(url: str, args: argparse.Namespace, body: bytes) -> dict[str, float]:
    limits = httpx.Limits(max_connections=args.bodies + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        stop = asyncio.Event()
        prober = asyncio.create_task(probe(client, url, args.probe_ms / 1000, stop))
        streamer = asyncio.create_task(stream_gaps(client, url, stop))
        await asyncio.sleep(0.5)
        start = time.perf_counter()
        headers = {"Content-Type": "application/json"}
        posts = [
            client.post(f"{url}/v1/chat/completions", content=body, headers=headers, timeout=600)
            for _ in range(args.bodies)
        ]
        statuses = [r.status_code for r in await asyncio.gather(*posts)]
        elapsed = time.perf_counter() - start
        stop.set()
        latencies = sorted(await prober)
        worst_gap = await streamer
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {
        "bodies_s": elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * p99,
        "max_ms": 1000 * latencies[-1],
        "stream_gap_ms": 1000 * worst_gap,
        "statuses": statuses,
    }


def near_limit_body(num_bytes: int) -> bytes:
    words = "the quick brown fox jumps over the lazy dog "
    text = (words * (num_bytes // len(words) + 1))[: num_bytes - 200]
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()


def main() -> None:
    args = parse_args()
    repos = [Path(r).resolve() for r in (args.repo or ["."])]
    body = near_limit_body(args.body_bytes)
    servers = {}
    try:
        for i, repo in enumerate(repos):
            port = args.port + i
            servers[repo] = (start_server(repo, port, args.model), f"http://127.0.0.1:{port}")
        results: dict[Path, list[dict]] = {repo: [] for repo in repos}
        for round_index in range(args.rounds):
            order = repos if round_index % 2 == 0 else repos[::-1]
            for repo in order:
                results[repo].append(asyncio.run(one_round(servers[repo][1], args, body)))
        print(f"{args.bodies} concurrent bodies of {len(body)} bytes, {args.rounds} rounds")
        print("| checkout | bodies done (s) | /health p50 ms | p99 ms | max ms | stream gap ms |")
        print("|---|---|---|---|---|---|")
        for repo, rows in results.items():
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "statuses"}
            print(
                f"| {repo} | {med['bodies_s']:.2f} | {med['p50_ms']:.1f} | {med['p99_ms']:.1f} "
                f"| {med['max_ms']:.1f} | {med['stream_gap_ms']:.1f} |"
            )
            print(f"statuses: {[r['statuses'] for r in rows]}", file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
