"""tools/bench_serving.py against our server: the report is consistent.

The tool starts our server on the embedded default model (greedy English text: one streamed
chunk per token, so ITL gaps = output tokens - 1 exactly); the tiny random checkpoint writes
random bytes that the detokenizer holds until a character completes, so there the chunks can
only be fewer.

Oracles: the seeded sample mix (the output lengths it asked for, forced with ignore_eos), the
stream's own usage, and arithmetic between the fields (ITL gaps = output tokens - 1 per request,
TTFT <= E2E, throughput = tokens / duration).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from serve_fixtures import API_KEY, ThreadedServer, free_port, save_serve_checkpoint

pytestmark = pytest.mark.slow  # a real HTTP server; CI still runs it

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_serving.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_serving", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path, _ = save_serve_checkpoint(tmp_path_factory.mktemp("bench_serving") / "tiny")
    running = ThreadedServer(path, max_total_tokens=4096)
    yield running
    running.stop()


def _check_run(run, samples, exact_chunks: bool):
    assert run["num_requests"] == run["completed"] == len(samples) and run["failed"] == 0
    requests = run["requests"]
    assert [r["output_tokens"] for r in requests] == [s.output_len for s in samples]
    for r in requests:
        if exact_chunks:
            assert len(r["itl"]) == r["output_tokens"] - 1
        else:
            assert len(r["itl"]) <= r["output_tokens"] - 1
        assert 0 < r["ttft"] <= r["e2e"]
        assert r["ttft"] + sum(r["itl"]) <= r["e2e"] + 1e-6
    assert run["total_output_tokens"] == sum(s.output_len for s in samples)
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration_s"])
    assert run["request_throughput"] == pytest.approx(len(samples) / run["duration_s"])
    for name in ("ttft_ms", "e2e_ms"):
        assert 0 < run[name]["p50"] <= run[name]["p99"]
    assert run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]


def test_report_on_the_server_it_starts(tmp_path):
    tool = _load_tool()
    out, png = tmp_path / "report.json", tmp_path / "plot.png"
    argv = [
        "--concurrency",
        "1",
        "2",
        "--num-prompts",
        "3",
        "--seed",
        "3",
        "--port",
        str(free_port()),
    ]
    argv += [
        "--input-len",
        "4",
        "12",
        "--output-len",
        "3",
        "9",
        "--out",
        str(out),
        "--plot",
        str(png),
    ]
    report = tool.main(argv)
    samples = tool.make_samples(3, [4, 12], [3, 9], 3)
    assert [run["concurrency"] for run in report["runs"]] == [1, 2]
    for run in report["runs"]:
        _check_run(run, samples, exact_chunks=True)
        for name in ("tpot_ms", "itl_ms"):
            assert 0 < run[name]["p50"] <= run[name]["p99"]
    assert out.exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 0


def test_report_for_a_given_url_and_the_chat_endpoint(server):
    tool = _load_tool()
    argv = ["--base-url", server.base_url, "--api-key", API_KEY, "--endpoint", "chat"]
    argv += ["--concurrency", "2", "--num-prompts", "3", "--seed", "4"]
    argv += ["--input-len", "4", "12", "--output-len", "3", "9"]
    report = tool.main(argv)
    [run] = report["runs"]
    _check_run(run, tool.make_samples(3, [4, 12], [3, 9], 4), exact_chunks=False)


def test_the_sample_mix_is_seeded():
    tool = _load_tool()
    first, again = (
        tool.make_samples(8, [4, 40], [3, 90], 1),
        tool.make_samples(8, [4, 40], [3, 90], 1),
    )
    assert first == again and first != tool.make_samples(8, [4, 40], [3, 90], 2)
    assert all(3 <= s.output_len <= 90 and 4 <= len(s.prompt.split()) <= 40 for s in first)
