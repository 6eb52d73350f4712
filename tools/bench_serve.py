"""What the HTTP layer costs: the same AsyncEngine driven directly and through the server.

Both paths run in one process against one engine: `direct` calls `AsyncEngine.generate`, `http`
sends OpenAI streaming completions over a real socket to uvicorn (in a thread) with httpx. The
difference is what serve/ adds (request parsing, pydantic, SSE framing, the client's own parsing
too, so the figure is pessimistic). Runs alternate direct/http and http/direct so drift on a
shared machine hits both; the table reports medians and the http/direct ratio.

    .venv/bin/python tools/bench_serve.py --concurrency 1 8 --max-tokens 64 --repeats 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

import httpx
import uvicorn

from torch_runner import AsyncEngine, Engine, SamplingParams
from torch_runner.serve.app import create_app
from torch_runner.serve.server import serving_state

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="Model folder (default: the embedded SmolLM2-135M-Instruct)."
    )
    parser.add_argument("--dtype", default="auto", help="Engine dtype (default: auto).")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8], help="Concurrent requests per run."
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="Tokens generated per request (EOS ignored)."
    )
    parser.add_argument(
        "--repeats", type=int, default=4, help="Runs per (mode, concurrency); even = both orders."
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)."
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval (GIL hand-off, seconds).",
    )
    parser.add_argument("--port", type=int, default=18931, help="Port for the in-process server.")
    return parser.parse_args()


async def run_direct(
    engine: AsyncEngine, prompt_ids: list[int], concurrency: int, max_tokens: int, tag: str
):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int) -> float:
        start = time.perf_counter()
        first = None
        async for _ in engine.generate(f"{tag}-{i}", prompt_ids, params):
            first = first or time.perf_counter() - start
        return first

    start = time.perf_counter()
    ttfts = await asyncio.gather(*(one(i) for i in range(concurrency)))
    return time.perf_counter() - start, statistics.median(ttfts)


async def run_http(base_url: str, concurrency: int, max_tokens: int):
    body = {"model": "default", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0}
    body |= {"ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> float:
        start = time.perf_counter()
        first = None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and first is None and json.loads(line[6:])["choices"]:
                    first = time.perf_counter() - start
        return first

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        ttfts = await asyncio.gather(*(one(client) for _ in range(concurrency)))
        return time.perf_counter() - start, statistics.median(ttfts)


def main() -> None:
    args = parse_args()
    if args.switch_interval:
        import sys

        sys.setswitchinterval(args.switch_interval)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = Engine(model=args.model, device="cpu", dtype=args.dtype)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    state = serving_state(
        engine, async_engine, model_name="bench", api_key=None, max_body_bytes=1 << 20
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(state), host="127.0.0.1", port=args.port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    base_url = f"http://127.0.0.1:{args.port}"
    prompt_ids = list(engine.tokenizer(PROMPT).input_ids)
    asyncio.run(run_direct(async_engine, prompt_ids, 1, 4, "warm"))
    asyncio.run(run_http(base_url, 1, 4))

    rows = []
    for concurrency in args.concurrency:
        results: dict[str, list[tuple[float, float]]] = {"direct": [], "http": []}
        for repeat in range(args.repeats):
            order = ("direct", "http") if repeat % 2 == 0 else ("http", "direct")
            for mode in order:
                if mode == "direct":
                    tag = f"c{concurrency}-r{repeat}"
                    run = run_direct(async_engine, prompt_ids, concurrency, args.max_tokens, tag)
                else:
                    run = run_http(base_url, concurrency, args.max_tokens)
                results[mode].append(asyncio.run(run))
        tokens = concurrency * args.max_tokens
        tps = {
            mode: statistics.median(tokens / wall for wall, _ in runs)
            for mode, runs in results.items()
        }
        ttft = {mode: statistics.median(t for _, t in runs) * 1e3 for mode, runs in results.items()}
        rows.append((concurrency, tps["direct"], tps["http"], ttft["direct"], ttft["http"]))
    server.should_exit = True
    async_engine.shutdown()

    print(
        f"\nmodel: {engine.model_path}  dtype: {engine.dtype}  max_tokens: {args.max_tokens}  repeats: {args.repeats}\n"
    )
    print(
        "| concurrency | direct tok/s | http tok/s | http/direct | direct TTFT ms | http TTFT ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for concurrency, direct, http, ttft_direct, ttft_http in rows:
        print(
            f"| {concurrency} | {direct:.1f} | {http:.1f} | {http / direct:.2f} | {ttft_direct:.0f} | {ttft_http:.0f} |"
        )


if __name__ == "__main__":
    main()
