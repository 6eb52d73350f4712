"""Host time per token of the incremental detokenizer: transformers' `decode` against the fast
tokenizer's Rust backend (the path `IncrementalDetokenizer` takes when the tokenizer does no
space clean-up), on the same random ids, interleaved; checks both give the same text.

    PYTHONPATH=. python tools/bench_detokenizer.py [--tokenizer DIR] [--tokens 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from functools import partial

from torch_runner.detokenizer import IncrementalDetokenizer


def run(tokenizer, ids: list[int], use_backend: bool) -> tuple[float, str]:
    detok = IncrementalDetokenizer(tokenizer, ids[:5])
    if not use_backend:
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
    times = {True: [], False: []}
    texts = {}
    for _ in range(args.repeats):
        for mode in (False, True):
            us, texts[mode] = run(tokenizer, ids, mode)
            times[mode].append(us)
    slow, fast = statistics.median(times[False]), statistics.median(times[True])
    print(f"transformers decode: {slow:.2f} us/token, backend: {fast:.2f} us/token "
          f"({slow / fast:.2f}x); same text: {texts[True] == texts[False]}")  # fmt: skip


if __name__ == "__main__":
    main()
