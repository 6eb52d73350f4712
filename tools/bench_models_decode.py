"""Decode-step A/B: the working tree's models/ + ops/ against a git revision's, same weights.

Why: the decode path is launch-bound on a GPU and overhead-heavy on CPU at small batch, so a
change to the per-layer path (rope tables, fused matmuls, casts) is judged by aten ops per step
and step time against the code before it. The baseline revision's `models/` and `ops/` are
exported (`git archive`) into a temporary package pair `models_base` / `ops_base`, so both run
in ONE process on identical weights and one paged pool; rounds alternate which goes first, and
the table reports medians and the ratio new / base. Rows are decode steps of B requests whose
contexts differ (continuous batching), through torch_runner's PagedKVPool.

    .venv/bin/python tools/bench_models_decode.py --base 9f317aa --batches 1 32 --dtypes float32
"""

from __future__ import annotations

import argparse
import collections
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import models  # noqa: E402
from models.default_model import default_model_path  # noqa: E402
from torch_runner.kv.caches import PagedKVPool, PagedLayerView, PagedStepMeta  # noqa: E402

BLOCK = 16


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="git revision of the baseline models/ops")
    parser.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32], help="decode rows")
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"]
    )
    parser.add_argument("--context", type=int, default=128, help="tokens already cached per row")
    parser.add_argument("--steps", type=int, default=5, help="decode steps per timed round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per side (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return parser.parse_args(argv)


def export_baseline(rev: str, dest: Path) -> None:
    """`git archive` rev's models/ and ops/ into dest as models_base/ and ops_base/."""
    blob = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "models", "ops"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(dest, filter="data")
    for pkg in ("models", "ops"):
        (dest / pkg).rename(dest / f"{pkg}_base")
    for path in dest.rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bfrom (models|ops)\b", r"from \1_base", text)
        text = re.sub(r"\bimport (models|ops)\b", r"import \1_base as \1", text)
        text = re.sub(r"\"(models|ops)\.", r'"\1_base.', text)
        path.write_text(text)


def decode_steps(model, pool, args, batch, context, steps):
    tables = [list(range(i * pool.row_blocks, (i + 1) * pool.row_blocks)) for i in range(batch)]
    starts0 = [context - (i * 7) % 32 for i in range(batch)]  # rows of different lengths
    ids = torch.full((batch, 1), 1000)
    for t in range(steps):
        starts = [s + t for s in starts0]
        meta = PagedStepMeta(tables, starts, [1] * batch, BLOCK, "cpu", pool.pad_slot)
        caches = [PagedLayerView(pool, i, meta) for i in range(args.num_hidden_layers)]
        hidden = model(ids, torch.tensor(starts)[:, None], caches)  # [B, 1, H]
        model.compute_logits(hidden[:, -1])


def ops_per_step(run, steps) -> tuple[int, int, int]:
    """(aten ops, aten::mm, aten::_to_copy) per step, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    counts = collections.Counter(e.name for e in prof.events())
    aten = sum(v for k, v in counts.items() if k.startswith("aten::"))
    return aten // steps, counts["aten::mm"] // steps, counts["aten::_to_copy"] // steps


@torch.no_grad()
def bench(base_models, path, dtype, batch, opts):
    new = models.load_model(path, device="cpu", dtype=dtype).model
    base = base_models.load_model(path, device="cpu", dtype=dtype).model
    args = new.args
    row_blocks = (opts.context + opts.steps) // BLOCK + 2
    pool = PagedKVPool(
        args.num_hidden_layers,
        batch * row_blocks,
        BLOCK,
        args.num_key_value_heads,
        args.head_dim,
        getattr(torch, dtype),
        "cpu",
    )
    pool.row_blocks = row_blocks
    pool.k.normal_(generator=torch.Generator().manual_seed(0))
    pool.v.normal_(generator=torch.Generator().manual_seed(1))
    sides = {"base": base, "new": new}
    runs = {
        name: (lambda m=m: decode_steps(m, pool, args, batch, opts.context, opts.steps))
        for name, m in sides.items()
    }
    counts = {}
    for name, run in runs.items():
        run()  # warm-up
        counts[name] = ops_per_step(run, opts.steps)
    times = {"base": [], "new": []}
    for r in range(opts.repeats):
        for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
            start = time.perf_counter()
            runs[name]()
            times[name].append((time.perf_counter() - start) / opts.steps * 1e3)
    return counts, {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    opts = parse_args(argv)
    torch.set_num_threads(opts.threads)
    path = opts.model or default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        export_baseline(opts.base, Path(tmp))
        sys.path.insert(0, tmp)
        import models_base

        print(f"base={opts.base}, context={opts.context}, {opts.steps} steps x {opts.repeats}")
        print("| dtype | batch | aten ops/step base -> new | mm/step | _to_copy/step |", end="")
        print(" ms/step base | ms/step new | new/base |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for dtype in opts.dtypes:
            for batch in opts.batches:
                counts, ms = bench(models_base, path, dtype, batch, opts)
                (ab, mb, cb), (an, mn, cn) = counts["base"], counts["new"]
                print(
                    f"| {dtype} | {batch} | {ab} -> {an} | {mb} -> {mn} | {cb} -> {cn} | "
                    f"{ms['base']:.1f} | {ms['new']:.1f} | {ms['new'] / ms['base']:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
