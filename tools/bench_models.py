"""Benchmark the model loader and a full-prompt forward: torch_runner vs transformers.

Why: the loader builds on `meta` and assigns memory-mapped safetensors (no init, no copy in
the checkpoint dtype on CPU); this measures what that buys over `from_pretrained`, and checks
that routing every op through `ops` costs nothing in a plain prefill forward. Same weights,
same process, side by side: each round runs both implementations, alternating which goes first,
and the table reports medians and the ratio ours / transformers.

    .venv/bin/python tools/bench_models.py --repeats 5 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import models  # noqa: E402
from models.default_model import default_model_path  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M)"
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16", "float16"],
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="rounds per measurement (median reported)"
    )
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens in the prefill forward")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    return parser.parse_args(argv)


def load_ours(path, dtype):
    return models.load_model(path, device="cpu", dtype=dtype).model


def load_hf(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).eval()


@torch.no_grad()
def prefill_ours(model, ids):
    positions = torch.arange(ids.shape[1])[None]
    return model.compute_logits(model(ids, positions, None)[:, -1])


@torch.no_grad()
def prefill_hf(model, ids):
    return model(ids, logits_to_keep=1).logits[:, -1]


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def bench_dtype(path, dtype, repeats, prompt_len):
    load_times = {"ours": [], "hf": []}
    prefill_times = {"ours": [], "hf": []}
    ids = torch.randint(100, 10000, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    max_diff = 0.0
    for round_idx in range(repeats):
        order = ("ours", "hf") if round_idx % 2 == 0 else ("hf", "ours")
        loaded = {}
        for name in order:
            gc.collect()
            seconds, loaded[name] = timed(load_ours if name == "ours" else load_hf, path, dtype)
            load_times[name].append(seconds)
        for name in order:
            fn = prefill_ours if name == "ours" else prefill_hf
            fn(loaded[name], ids)  # warm-up
            seconds, logits = timed(fn, loaded[name], ids)
            prefill_times[name].append(seconds)
            loaded[f"{name}_logits"] = logits
        diff = (loaded["ours_logits"].float() - loaded["hf_logits"].float()).abs().max().item()
        max_diff = max(max_diff, diff)
        del loaded
    return load_times, prefill_times, max_diff


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_model_path()
    print(
        f"model: {path}  threads: {args.threads}  repeats: {args.repeats}  prompt: {args.prompt_len} tokens\n"
    )
    print(
        "| dtype | measure | torch_runner (median) | transformers (median) | ratio ours/hf | max abs logit diff |"
    )
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        loads, prefills, diff = bench_dtype(path, dtype, args.repeats, args.prompt_len)
        for label, times, unit, scale in (
            ("load", loads, "s", 1.0),
            ("prefill", prefills, "ms", 1000.0),
        ):
            ours, hf = (
                statistics.median(times["ours"]) * scale,
                statistics.median(times["hf"]) * scale,
            )
            print(
                f"| {dtype} | {label} | {ours:.2f} {unit} | {hf:.2f} {unit} | {ours / hf:.2f} | {diff:.2e} |"
            )


if __name__ == "__main__":
    main()
