"""Benchmark the sampler: time per call, torch vs MLX, against the decode step it rides on.

For every (batch, vocab, mix) the torch and MLX samplers run side by side in one process,
alternating which goes first on each repeat (both run orders), and the table reports medians
and the MLX / torch ratio. `SamplingBatch.build` (host work the engine pays every step) is timed
separately. A decode step of the default model (SmolLM2-135M geometry) is timed in the same
interleaved loop, so the last column is the sampler's share of a step at that batch size,
measured side by side (vocab 49152 rows only). `--decode-step` picks the step:
  hf-dummy  a dummy-weights transformers LlamaForCausalLM, one decode token per row over a
            --context KV cache (independent of engine changes);
  engine    torch_runner's own `Engine.step()` with `batch` running greedy requests of the
            default model (prompts of --context random tokens; each call decodes one more
            token per row, so the KV grows by one per call);
  both      both columns.
`--logits model` feeds the sampler real logits of the default model (an English paragraph,
one position per row) instead of synthetic ones.

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

from ops.sampling.batch import SamplingBatch  # noqa: E402
from ops.sampling.params import SamplingParams  # noqa: E402
from ops.sampling.sampler import sample as torch_sample  # noqa: E402

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
        choices=("hf-dummy", "engine", "both", "none"),
        default="hf-dummy",
        help="which SmolLM2-135M decode step to time beside the sampler (default: %(default)s)",
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
        choices=("zipf", "randn", "model"),
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


class EngineDecodeStep:
    """`Engine.step()` of the default model with `batch` greedy requests, all decoding (their
    prompts of `context` random tokens are prefilled here, before any timing)."""

    def __init__(self, batch: int, context: int, dtype: str, max_steps: int = 4096):
        from torch_runner import Engine

        self.engine = Engine(None, device="cpu", dtype=dtype, max_num_seqs=batch,
                             max_total_tokens=batch * (context + max_steps + 16),
                             enable_prefix_caching=False)  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=max_steps, ignore_eos=True)
        gen = torch.Generator().manual_seed(0)
        vocab = self.engine.vocab_size
        for _ in range(batch):
            self.engine.add_request(
                None, torch.randint(0, vocab, (context,), generator=gen).tolist(), params
            )
        decoding = set()
        while len(decoding) < batch:  # prefill (possibly over several steps) until all decode
            decoding.update(out.request_id for out in self.engine.step())

    def __call__(self):
        self.engine.step()


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


STEP_COLUMNS = {  # --decode-step name -> (timed fn key, step column, share column)
    "hf-dummy": ("step", "decode step ms", "(build + torch) / step"),
    "engine": ("engine", "engine step ms", "(build + torch) / engine step"),
}


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
    steps = (
        []
        if "torch" not in impls
        else {"none": [], "both": list(STEP_COLUMNS)}.get(args.decode_step, [args.decode_step])
    )
    header = ["batch", "vocab", "mix", "build ms"] + [f"{k} ms" for k in impls]
    if "mlx" in impls and "torch" in impls:
        header.append("mlx/torch")
    for name in steps:
        header += list(STEP_COLUMNS[name][1:])
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
            timed_steps = {}
            if vocab == SMOLLM2["vocab_size"]:
                if "hf-dummy" in steps:
                    timed_steps["step"] = DecodeStep(b, args.context, dtype)
                if "engine" in steps:
                    timed_steps["engine"] = EngineDecodeStep(b, args.context, args.dtype)
            for mix in args.mix:
                params = [MIXES[mix](i) for i in range(b)]
                med = measure(impls, logits, params, args.repeats, args.warmup, timed_steps)
                row = [str(b), str(vocab), mix, f"{med['build']:.3f}"]
                row += [f"{med[k]:.2f}" for k in impls]
                if "mlx" in impls and "torch" in impls:
                    row.append(f"{med['mlx'] / med['torch']:.2f}")
                for name in steps:
                    key = STEP_COLUMNS[name][0]
                    if key in med:
                        share = 100 * (med["torch"] + med["build"]) / med[key]
                        row += [f"{med[key]:.1f}", f"{share:.1f}%"]
                    else:
                        row += ["-", "-"]
                print("| " + " | ".join(row) + " |", flush=True)


PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Within a few decades, "
    "printing shops had spread to more than two hundred cities across Europe, and the price of "
    "books fell sharply. Scholars could compare identical copies of a text, merchants printed "
    "forms and price lists, and reformers used pamphlets to reach readers far beyond their own "
    "towns. Historians still debate how quickly literacy rose, but most agree that the press "
    "changed how knowledge was stored, checked and shared."
)


def make_logits(kind: str, batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """[B, V] fp32 logits: `zipf` (log-probs ~ -1.5 log rank, shuffled ids: language-like, the
    top-p 0.9 nucleus fits in the 1024 candidates, as on real SmolLM2 logits), `randn`
    (N(0, 9): a flat distribution whose nucleus is thousands of tokens, the worst case) or
    `model` (the default model's logits at successive positions of PARAGRAPH, vocab 49152)."""
    if kind == "model":
        return model_logits(batch, vocab)
    if kind == "randn":
        return torch.randn(batch, vocab, generator=gen) * 3
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -1.5 * ranks.log()
    rows = [base[torch.randperm(vocab, generator=gen)] for _ in range(batch)]
    return torch.stack(rows) + 0.1 * torch.randn(batch, vocab, generator=gen)


@functools.cache
def _paragraph_logits() -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.default_model import default_model_path

    path = default_model_path()
    ids = AutoTokenizer.from_pretrained(path)(PARAGRAPH, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(ids).logits[0]  # [T, 49152]


def model_logits(batch: int, vocab: int) -> torch.Tensor:
    if vocab != SMOLLM2["vocab_size"]:
        raise SystemExit(f"--logits model needs --vocab {SMOLLM2['vocab_size']}; got {vocab}")
    logits = _paragraph_logits()
    return logits[torch.arange(batch) % logits.shape[0]].contiguous()


def measure(
    impls: dict, logits, params: list, repeats: int, warmup: int, steps: dict | None = None
) -> dict[str, float]:
    """Median ms per sampler call (each impl), per SamplingBatch.build and per decode step in
    `steps` (name -> fn), all interleaved in one loop so machine load hits them alike."""
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
    fns.update(steps or {})
    return time_calls(fns, repeats, warmup)


if __name__ == "__main__":
    main()
