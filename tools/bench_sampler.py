"""Benchmark the sampler: time per call, torch vs MLX, against the decode step it rides on.

For every (batch, vocab, mix) the torch and MLX samplers run side by side in one process,
alternating which goes first on each repeat (both run orders), and the table reports medians
and the MLX / torch ratio. `SamplingBatch.build` (host work the engine pays every step) is timed
separately. The decode step of the default model (SmolLM2-135M geometry) is estimated with a
dummy-weights transformers LlamaForCausalLM: one decode token per row over a short KV cache, so
the "% of step" column reads the sampler's share of a step at that batch size (vocab 49152).

Example:
    .venv/bin/python tools/bench_sampler.py --batch 1,8,32,64 --vocab 49152,151936,201088
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ops.sampling import sample as torch_sample  # noqa: E402
from ops.sampling_batch import SamplingBatch  # noqa: E402
from ops.sampling_params import SamplingParams  # noqa: E402

MIXES = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "temperature": lambda i: SamplingParams(temperature=0.8),
    "top_p": lambda i: SamplingParams(temperature=0.8, top_p=0.9),
    "top_k50": lambda i: SamplingParams(temperature=0.8, top_k=50),
    "seeded": lambda i: SamplingParams(temperature=0.8, seed=1000 + i),
    "seeded_top_k50": lambda i: SamplingParams(temperature=0.8, top_k=50, seed=1000 + i),
    "logprobs": lambda i: SamplingParams(temperature=0.8, top_k=50, logprobs=True, top_logprobs=5),
}
DEFAULT_MIXES = "greedy,temperature,top_p,top_k50,seeded"
SMOLLM2 = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--batch", default="1,8,32,64", help="comma list of batch sizes (default: %(default)s)"
    )
    parser.add_argument(
        "--vocab",
        default="49152,151936,201088",
        help="comma list of vocabulary sizes (default: %(default)s)",
    )
    parser.add_argument(
        "--mix",
        default=DEFAULT_MIXES,
        help=f"comma list of row mixes, from: {', '.join(MIXES)} (default: %(default)s)",
    )
    parser.add_argument(
        "--impl", default="torch,mlx", help="comma list from: torch, mlx (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=7,
        help="timed calls per implementation (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed calls first (default: %(default)s)"
    )
    parser.add_argument(
        "--decode-step",
        choices=("hf-dummy", "none"),
        default="hf-dummy",
        help="estimate the SmolLM2-135M decode step per batch with dummy weights (default: %(default)s)",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=128,
        help="KV length for the decode-step estimate (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="logits / model dtype (default: %(default)s)",
    )
    parser.add_argument(
        "--logits",
        choices=("zipf", "randn"),
        default="zipf",
        help="synthetic logits shape (default: %(default)s)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = parser.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    args.vocab = [int(v) for v in args.vocab.split(",")]
    args.mix = [m.strip() for m in args.mix.split(",")]
    args.impl = [i.strip() for i in args.impl.split(",")]
    for m in args.mix:
        if m not in MIXES:
            parser.error(f"--mix {m!r} is not known; allowed values: {', '.join(MIXES)}")
    for i in args.impl:
        if i not in ("torch", "mlx"):
            parser.error(f"--impl {i!r} is not known; allowed values: torch, mlx")
    return args


def decode_step_ms(batch: int, context: int, dtype: torch.dtype, repeats: int) -> float:
    """Median ms of one decode token per row, SmolLM2-135M geometry, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(dtype).eval()
    prompt = torch.randint(0, SMOLLM2["vocab_size"], (batch, context))
    with torch.inference_mode():
        out = model(prompt, use_cache=True)
        cache = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(repeats + 1):  # the first step warms up
            start = time.perf_counter()
            model(token, cache=cache, use_cache=True)
            times.append((time.perf_counter() - start) * 1e3)
            cache.crop(-1)  # every step decodes position `context`
    return statistics.median(times[1:])


def time_calls(fns: dict, repeats: int, warmup: int) -> dict[str, float]:
    """Median ms per call for each fn, alternating which runs first on each repeat."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    impls = {"torch": torch_sample}
    if "mlx" in args.impl:
        from ops.mlx.sampling import sample as mlx_sample

        impls["mlx"] = mlx_sample
    impls = {k: v for k, v in impls.items() if k in args.impl}
    steps = {}
    if args.decode_step != "none":
        for b in args.batch:
            steps[b] = decode_step_ms(b, args.context, dtype, max(3, args.repeats // 2))
    header = ["batch", "vocab", "mix", "build ms"] + [f"{k} ms" for k in impls]
    if "mlx" in impls and "torch" in impls:
        header.append("mlx/torch")
    if steps:
        header += ["decode step ms", "torch % of step"]
    print(
        f"# sampler benchmark ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch threads "
        f"{torch.get_num_threads()}, logits {args.logits} {args.dtype}, medians of {args.repeats}, alternating order)\n"
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    gen = torch.Generator().manual_seed(0)
    for vocab in args.vocab:
        for b in args.batch:
            logits = make_logits(args.logits, b, vocab, gen).to(dtype)
            for mix in args.mix:
                params = [MIXES[mix](i) for i in range(b)]
                med = measure(impls, logits, params, args.repeats, args.warmup)
                row = [str(b), str(vocab), mix, f"{med['build']:.3f}"]
                row += [f"{med[k]:.2f}" for k in impls]
                if "mlx" in impls and "torch" in impls:
                    row.append(f"{med['mlx'] / med['torch']:.2f}")
                if steps:
                    row.append(f"{steps[b]:.1f}")
                    is_default_model = vocab == SMOLLM2["vocab_size"] and "torch" in impls
                    share = (
                        100 * (med["torch"] + med["build"]) / steps[b] if is_default_model else None
                    )
                    row.append(f"{share:.1f}%" if share is not None else "-")
                print("| " + " | ".join(row) + " |", flush=True)


def make_logits(kind: str, batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """[B, V] fp32 logits: `zipf` (log-probs ~ -1.5 log rank, shuffled ids: language-like, the
    top-p 0.9 nucleus fits in the 1024 candidates, as on real SmolLM2 logits) or `randn`
    (N(0, 9): a flat distribution whose nucleus is thousands of tokens, the worst case)."""
    if kind == "randn":
        return torch.randn(batch, vocab, generator=gen) * 3
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -1.5 * ranks.log()
    rows = [base[torch.randperm(vocab, generator=gen)] for _ in range(batch)]
    return torch.stack(rows) + 0.1 * torch.randn(batch, vocab, generator=gen)


def measure(
    impls: dict, logits: torch.Tensor, params: list, repeats: int, warmup: int
) -> dict[str, float]:
    """Median ms per sampler call (each impl) and per SamplingBatch.build, one process."""
    rows, vocab = logits.shape
    positions = torch.arange(rows, dtype=torch.int64) + 100
    prompts, outputs = [list(range(32))] * rows, [list(range(16))] * rows

    def build():
        return SamplingBatch.build(params, prompts, outputs, vocab, "cpu")

    batch = build()
    fns = {
        name: functools.partial(fn, logits, batch, positions, torch.Generator().manual_seed(1))
        for name, fn in impls.items()
    }
    fns["build"] = build
    return time_calls(fns, repeats, warmup)


if __name__ == "__main__":
    main()
