"""Benchmark the sampler: time per call, torch vs MLX, against the decode step it rides on.

For every (batch, vocab, mix) the torch and MLX samplers run side by side in one process,
alternating which goes first on each repeat (both run orders), and the table reports medians
and the MLX / torch ratio. `SamplingBatch.build` (host work the engine pays every step) is timed
separately. The decode step of the default model (SmolLM2-135M geometry) is estimated with a
dummy-weights transformers LlamaForCausalLM (one decode token per row over a --context KV
cache), timed in the same interleaved loop, so the last column is the sampler's share of a
step at that batch size, measured side by side (vocab 49152 rows only).

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
    "min_p": lambda i: SamplingParams(temperature=0.8, min_p=0.05),
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
        help="time the SmolLM2-135M decode step (dummy weights) beside the sampler (default: %(default)s)",
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


class DecodeStep:
    """One decode token per row of SmolLM2-135M geometry (random weights) over a `context`-long
    KV cache; each call decodes the same position, so calls are comparable."""

    _model = None

    def __init__(self, batch: int, context: int, dtype: torch.dtype):
        from transformers import LlamaConfig, LlamaForCausalLM

        if DecodeStep._model is None or DecodeStep._model.dtype != dtype:
            torch.manual_seed(0)
            DecodeStep._model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(dtype).eval()
        self.model = DecodeStep._model
        prompt = torch.randint(0, SMOLLM2["vocab_size"], (batch, context))
        with torch.inference_mode():
            out = self.model(prompt, use_cache=True)
        self.cache = out.past_key_values
        self.token = out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def __call__(self):
        self.model(self.token, cache=self.cache, use_cache=True)
        self.cache.crop(-1)


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
    with_step = args.decode_step != "none" and "torch" in impls
    header = ["batch", "vocab", "mix", "build ms"] + [f"{k} ms" for k in impls]
    if "mlx" in impls and "torch" in impls:
        header.append("mlx/torch")
    if with_step:
        header += ["decode step ms", "(build + torch) / step"]
    print(
        f"# sampler benchmark ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch threads "
        f"{torch.get_num_threads()}, logits {args.logits} {args.dtype}, medians of {args.repeats}, "
        "alternating order)\n"
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    gen = torch.Generator().manual_seed(0)
    for vocab in args.vocab:
        for b in args.batch:
            logits = make_logits(args.logits, b, vocab, gen).to(dtype)
            is_default_model = with_step and vocab == SMOLLM2["vocab_size"]
            step = DecodeStep(b, args.context, dtype) if is_default_model else None
            for mix in args.mix:
                params = [MIXES[mix](i) for i in range(b)]
                med = measure(impls, logits, params, args.repeats, args.warmup, step)
                row = [str(b), str(vocab), mix, f"{med['build']:.3f}"]
                row += [f"{med[k]:.2f}" for k in impls]
                if "mlx" in impls and "torch" in impls:
                    row.append(f"{med['mlx'] / med['torch']:.2f}")
                if step is not None:
                    share = 100 * (med["torch"] + med["build"]) / med["step"]
                    row += [f"{med['step']:.1f}", f"{share:.1f}%"]
                elif with_step:
                    row += ["-", "-"]
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
    impls: dict, logits, params: list, repeats: int, warmup: int, step=None
) -> dict[str, float]:
    """Median ms per sampler call (each impl), per SamplingBatch.build and (when given) per
    decode step, all interleaved in one loop so machine load hits them alike."""
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
    if step is not None:
        fns["step"] = step
    return time_calls(fns, repeats, warmup)


if __name__ == "__main__":
    main()
