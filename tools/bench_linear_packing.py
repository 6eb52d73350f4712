"""CPU matmul weights: dense [out, in] (`F.linear`, MKL) vs oneDNN-packed (`ops.pack_weight`,
what `weight_packing=auto` uses on CPU), optionally vs input-major dense ([in, out] in memory).

For every row count M (decode batch sizes and prefill chunks) the default model's matmuls (fused
q/k/v, o, fused gate/up, down: one distinct matrix per layer, so the weights stream from memory
as in a real step, plus the lm_head) run in every layout side by side, alternating the order on
every repeat; the table has medians and the dense / packed ratio.

    .venv/bin/python tools/bench_linear_packing.py --rows 1,2,4,8,16,32,64,128,512 --threads 2

`--dtype bfloat16` times bf16 weights; `--quantized` adds the weight-only int8 / int4 weights
(ops/quant/int_linear.py, with activations of --dtype) of the same matrices, so every kernel a
decode step can use streams the same model-sized set of weights in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ops

# SmolLM2-135M: hidden 576, 9 q heads / 3 kv heads of 64, intermediate 1536, 30 layers, 49152
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,512", help="M values (comma list)")
    parser.add_argument("--layers", type=int, default=30, help="distinct matrices per shape")
    parser.add_argument("--vocab", type=int, default=49152, help="lm_head rows (0: none)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per layout (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--input-major", action="store_true", help="also time dense weights stored [in, out]"
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--quantized", action="store_true", help="also time int8 / int4 weights of the matrices"
    )
    return parser.parse_args(argv)


def one_pass(mats: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for w in mats:
        ops.linear(inputs[w.shape[1]], w)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not ops.can_pack(dtype):
        raise SystemExit(f"this torch build / CPU cannot pack {args.dtype} weights (ops.can_pack)")
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(s, generator=gen) for s in SHAPES.values() for _ in range(args.layers)]
    dense += [torch.randn(args.vocab, 576, generator=gen)] if args.vocab else []
    dense = [w.to(dtype) for w in dense]
    layouts = {"dense": dense, "packed": [ops.pack_weight(w) for w in dense]}
    if args.input_major:
        layouts["input-major"] = [w.t().contiguous().t() for w in dense]
    if args.quantized:
        from ops.quant.int_linear import quantize_weight

        for mode in ("int8", "int4"):
            layouts[mode] = [quantize_weight(w, mode) for w in dense]
    total = sum(w.numel() * w.element_size() for w in dense)
    names = list(layouts)
    print(
        f"{len(dense)} matrices, {total / 2**20:.0f} MiB {args.dtype}, {torch.get_num_threads()} threads"
    )
    print("| rows | " + " | ".join(f"{n} ms" for n in names) + " | dense / packed |")
    print("|---:|" + "---:|" * (len(names) + 1))
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}
            times: dict[str, list[float]] = {n: [] for n in names}
            for n in names:
                one_pass(layouts[n], inputs)  # warm-up
            for r in range(args.repeats):
                for n in names if r % 2 == 0 else names[::-1]:
                    times[n].append(one_pass(layouts[n], inputs))
            med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
            cells = " | ".join(f"{med[n]:.1f}" for n in names)
            print(f"| {m} | {cells} | {med['dense'] / med['packed']:.2f}x |")


if __name__ == "__main__":
    main()
