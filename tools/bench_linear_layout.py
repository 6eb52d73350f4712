"""Linear weight layout on CPU: [out, in] as loaded (x @ W.T, BLAS "NT") vs input-major [in, out]
(the same values re-stored, BLAS "NN"), which `weight_packing=auto` picks on CPU.

For every row count M (decode batch sizes, and a prefill chunk) the default model's decode
matmuls (fused q/k/v, o, fused gate/up, down: one distinct matrix per layer, so the weights
stream from memory as in a real step, plus the lm_head) run in both layouts side by side,
alternating which goes first on every repeat; the table has medians and the ratio.

    .venv/bin/python tools/bench_linear_layout.py --rows 1,2,4,8,32,64,512 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, 9 q heads / 3 kv heads of 64, intermediate 1536, 30 layers, 49152
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,2,4,8,32,64,512", help="M values (comma list)")
    parser.add_argument("--layers", type=int, default=30, help="distinct matrices per shape")
    parser.add_argument("--vocab", type=int, default=49152, help="lm_head rows (0: none)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds per layout (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return parser.parse_args(argv)


def weights(layers: int, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    mats = [torch.randn(s, generator=gen) for s in SHAPES.values() for _ in range(layers)]
    return mats + ([torch.randn(vocab, 576, generator=gen)] if vocab else [])


def one_pass(mats: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for w in mats:
        F.linear(inputs[w.shape[1]], w)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    as_loaded = weights(args.layers, args.vocab)  # [out, in] row-major
    input_major = [w.t().contiguous().t() for w in as_loaded]  # same values, [in, out] in memory
    total_bytes = sum(w.numel() * w.element_size() for w in as_loaded)
    print(f"{len(as_loaded)} matrices, {total_bytes / 2**20:.0f} MiB fp32, {args.threads} threads")
    print("| rows | as loaded ms | input-major ms | speed-up | input-major GB/s |")
    print("|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(m, k) for k in (576, 1536)}
            times = {"loaded": [], "major": []}
            sides = [("loaded", as_loaded), ("major", input_major)]
            for _, mats in sides:
                one_pass(mats, inputs)  # warm-up
            for r in range(args.repeats):
                for name, mats in sides if r % 2 == 0 else sides[::-1]:
                    times[name].append(one_pass(mats, inputs))
            a, b = statistics.median(times["loaded"]), statistics.median(times["major"])
            print(
                f"| {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f}x | {total_bytes / b / 1e9:.1f} |"
            )


if __name__ == "__main__":
    main()
