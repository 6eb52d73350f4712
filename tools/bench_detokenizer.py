"""Host time per token of the incremental detokenizer: transformers' `decode`, the fast
tokenizer's Rust backend (the path `IncrementalDetokenizer` takes when the tokenizer does no
space clean-up) and the byte table (byte-level tokenizers), on the same random ids, interleaved;
checks all give the same text.

    PYTHONPATH=. python tools/bench_detokenizer.py [--tokenizer DIR] [--tokens 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from functools import partial

from torch_runner.detokenizer import IncrementalDetokenizer

MODES = ("transformers", "backend", "byte_table")


def run(tokenizer, ids: list[int], mode: str) -> tuple[float, str]:
    detok = IncrementalDetokenizer(tokenizer, ids[:5], use_byte_table=mode == "byte_table")
    if mode == "transformers":
        detok._decode = partial(tokenizer.decode, skip_special_tokens=True)
    t0 = time.perf_counter()
    for token in ids:
        detok.append(token)
    detok.flush()
    return (time.perf_counter() - t0) / len(ids) * 1e6, detok.text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", default=None, help="folder (default: the embedded model)")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    path = args.tokenizer
    if path is None:
        from models.default_model import default_model_path

        path = str(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    rng = random.Random(0)
    ids = [rng.randrange(3, min(tokenizer.vocab_size, 30000)) for _ in range(args.tokens)]
    times = {mode: [] for mode in MODES}
    texts = {}
    for _ in range(args.repeats):
        for mode in MODES:
            us, texts[mode] = run(tokenizer, ids, mode)
            times[mode].append(us)
    us = {mode: statistics.median(times[mode]) for mode in MODES}
    print(", ".join(f"{mode}: {us[mode]:.2f} us/token" for mode in MODES)
          + f"; same text: {len(set(texts.values())) == 1}")  # fmt: skip


if __name__ == "__main__":
    main()
