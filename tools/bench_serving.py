"""Online serving benchmark in the style of vLLM's benchmark_serving: streaming HTTP, concurrency.

For each --concurrency value, sends --num-prompts streaming requests (all at once, at most that
many in flight, as vLLM's `--max-concurrency` with an infinite request rate) to an
OpenAI-compatible server and reports throughput (requests/s, output tokens/s), TTFT, TPOT
(time per output token after the first), ITL (gaps between streamed chunks) and end-to-end
latency, p50/p99/mean in ms, as JSON (stdout and --out) and a PNG plot (--plot, when matplotlib
is installed). Prompts and output lengths are a seeded mix (--seed): input lengths uniform in
--input-len words, output lengths uniform in --output-len tokens, forced with `ignore_eos` (vLLM's
and llama.cpp's extension; --no-ignore-eos for servers without it). Output tokens are counted
from the stream's `usage` (`stream_options.include_usage`), else one per content chunk.

Without --base-url the tool starts `python -m torch_runner.serve` (--model, default the embedded
model) on --port and stops it at the end; with one, it benchmarks that server (vLLM, SGLang,
llama.cpp's llama-server, ...):

    .venv/bin/python tools/bench_serving.py --concurrency 1 16 64 --num-prompts 64
    .venv/bin/python tools/bench_serving.py --base-url http://127.0.0.1:8080 --model-name m
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

WORDS = [
    "the",
    "a",
    "river",
    "mountain",
    "city",
    "light",
    "morning",
    "engine",
    "story",
    "small",
    "quiet",
    "bright",
    "cold",
    "garden",
    "road",
    "window",
    "music",
    "paper",
    "stone",
    "letter",
    "market",
    "harbor",
    "forest",
    "winter",
    "summer",
    "bridge",
    "tower",
    "silver",
    "orange",
    "teacher",
    "doctor",
    "friend",
    "station",
    "island",
    "valley",
    "question",
    "answer",
    "number",
    "history",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--base-url", default=None, help="Server to benchmark (default: start ours)."
    )
    parser.add_argument(
        "--model", default=None, help="Model folder for our server (default: embedded)."
    )
    parser.add_argument(
        "--model-name", default=None, help="Model name to send (default: /v1/models' first)."
    )
    parser.add_argument("--api-key", default=None, help="Bearer token, if the server needs one.")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--num-prompts", type=int, default=64, help="Requests per concurrency.")
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX")
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ignore-eos", action="store_true", help="Do not send ignore_eos.")
    parser.add_argument("--port", type=int, default=8150, help="Port for the server started here.")
    parser.add_argument("--device", default="cpu", help="--device of the server started here.")
    parser.add_argument("--server-arg", action="append", default=[], help="Extra server flag.")
    parser.add_argument("--out", default=None, help="Write the JSON report here.")
    parser.add_argument("--plot", default=None, help="Write a PNG plot here (needs matplotlib).")
    parser.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout (s).")
    return parser.parse_args(argv)


@dataclass
class Sample:
    prompt: str
    output_len: int


def make_samples(num: int, input_len: list[int], output_len: list[int], seed: int) -> list[Sample]:
    """The seeded prompt / output-length mix (the same for every concurrency and server)."""
    rng = random.Random(seed)
    samples = []
    for _ in range(num):
        words = [rng.choice(WORDS) for _ in range(rng.randint(*input_len))]
        samples.append(Sample(" ".join(words), rng.randint(*output_len)))
    return samples


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from send to the first content chunk
    e2e: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between content chunks


def _body(args, sample: Sample, model: str) -> tuple[str, dict]:
    body: dict = {"model": model, "max_tokens": sample.output_len, "stream": True}
    body |= {"stream_options": {"include_usage": True}, "temperature": 0.0}
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = sample.prompt
    return "/v1/completions", body


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send(client: httpx.AsyncClient, args, sample: Sample, model: str) -> RequestResult:
    path, body = _body(args, sample, model)
    result, arrivals, usage = RequestResult(), [], None
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                usage = chunk.get("usage") or usage
                if any(_chunk_text(choice) for choice in chunk.get("choices") or []):
                    arrivals.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    end = time.perf_counter()
    if not arrivals:
        result.error = "no content in the stream"
        return result
    result.ok, result.e2e, result.ttft = True, end - start, arrivals[0] - start
    result.itl = [b - a for a, b in zip(arrivals, arrivals[1:])]
    result.output_tokens = usage["completion_tokens"] if usage else len(arrivals)
    result.prompt_tokens = usage["prompt_tokens"] if usage else 0
    return result


def _ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)

    def pct(q: float) -> float:  # nearest-rank on the sorted values (numpy's "linear" between)
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {"mean": statistics.fmean(ordered) * 1e3, "p50": pct(0.5) * 1e3, "p99": pct(0.99) * 1e3}


async def run_concurrency(args, samples: list[Sample], model: str, concurrency: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:

        async def one(sample: Sample) -> RequestResult:
            async with limit:
                return await send(client, args, sample, model)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(s) for s in samples))
        duration = time.perf_counter() - start
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "concurrency": concurrency,
        "num_requests": len(samples),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "ttft_ms": _ms([r.ttft for r in done]),
        "tpot_ms": _ms(tpot),
        "itl_ms": _ms([gap for r in done for gap in r.itl]),
        "e2e_ms": _ms([r.e2e for r in done]),
        "requests": [asdict(r) for r in results],
    }


def start_server(args) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch_runner.serve", "--port", str(args.port)]
    command += ["--device", args.device, "--log-level", "warning", *args.server_arg]
    command += ["--model", args.model] if args.model else []
    process = subprocess.Popen(command, env=os.environ.copy(), stdout=subprocess.DEVNULL)
    args.base_url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{args.base_url}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not start in 600 s")


def model_name(args) -> str:
    if args.model_name:
        return args.model_name
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    models = httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=30).json()
    return models["data"][0]["id"]


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    runs = report["runs"]
    xs = [run["concurrency"] for run in runs]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(xs, [run["output_throughput"] for run in runs], "o-")
    axes[0].set_title("output tokens/s")
    for name, ax in (("ttft_ms", axes[1]), ("itl_ms", axes[2])):
        for q in ("p50", "p99"):
            ax.plot(xs, [run[name][q] for run in runs], "o-", label=q)
        ax.set_title(name.removesuffix("_ms").upper() + " (ms)")
        ax.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
    figure.suptitle(f"{report['model']} @ {report['base_url']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    server = None if args.base_url else start_server(args)
    try:
        model = model_name(args)
        samples = make_samples(args.num_prompts, args.input_len, args.output_len, args.seed)
        warm = argparse.Namespace(**{**vars(args)})
        asyncio.run(run_concurrency(warm, samples[:1], model, 1))  # warm-up, not reported
        runs = [asyncio.run(run_concurrency(args, samples, model, c)) for c in args.concurrency]
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    report = {
        "base_url": args.base_url,
        "model": model,
        "endpoint": args.endpoint,
        "seed": args.seed,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "ignore_eos": not args.no_ignore_eos,
        "runs": runs,
    }
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
    if args.plot:
        plot(report, args.plot)
    summary = {k: v for k, v in report.items() if k != "runs"}
    summary["runs"] = [{k: v for k, v in run.items() if k != "requests"} for run in runs]
    print(json.dumps(summary, indent=1))
    return report


if __name__ == "__main__":
    main()
