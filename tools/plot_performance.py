"""Draw docs/img/*.png from the headline figures in docs/performance.md.

The numbers below are copied from that page (each with its date and the command that measured
it there); re-run this after updating them: `.venv/bin/python tools/plot_performance.py`.
Needs matplotlib (not a project dependency: `pip install matplotlib`).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "img"

# 2026-12-07, 2-core Intel Xeon (AVX-512 BF16 / VNNI, AMX), SmolLM2-135M batch-1 decode tok/s,
# medians of interleaved rounds, the mean of the two runs in opposite orders (docs/performance.md,
# CPU table; bf16 models for int8/int4; tools/bench_cpu_vs_llamacpp.py, llama-cpp-python 0.3.36
# built here, 2 threads).
CPU = {
    "fp32": {"torch_runner": 45.3, "llama.cpp": 40.35},
    "bf16": {"torch_runner": 70.9, "llama.cpp": 56.2},
    "int8 / q8_0": {"torch_runner": 110.65, "llama.cpp": 69.85},
    "int4 / Q4_1": {"torch_runner": 133.5, "llama.cpp": 83.95},
    "default GGUF / Q4_1": {"torch_runner": 125.65, "llama.cpp": 86.1},
}

# One NVIDIA H200, bf16 random weights, prompt 128 + 128 generated, decode tok/s
# (docs/performance.md, H200 table: tools/bench_cuda_decode.py; gpt-oss prompt 32 + 64). Ours:
# 1B / 8B batch 1 and gpt-oss from 2026-12-06 ~22:00 (session 20, one H200 call), 1B batch 64 from
# 2026-12-03 13:39, 8B batch 64 from 2026-12-02; llama.cpp 1B / 8B batch 1 in the same call as
# ours' 1,027.0 / 237.9 (2026-12-03 16:50-16:57), 1B b64 from the 2026-12-02 09:00 call, 8B b64 and
# gpt-oss from an earlier session (gpt-oss side by side on an H100, 12-07: ours 1.49x / 1.93x);
# HF from 2026-12-01.
H200 = {
    "Llama-3.2-1B b1": {"roofline": 1715, "torch_runner": 1116.9, "llama.cpp": 759.7, "HF": 108},
    "Llama-3.2-1B b64": {"roofline": 94632, "torch_runner": 47710, "llama.cpp": 17758, "HF": 5277},
    "Llama-3.1-8B b1": {"roofline": 283, "torch_runner": 249.0, "llama.cpp": 207.9, "HF": 48},
    "Llama-3.1-8B b64": {"roofline": 16365, "torch_runner": 11641, "llama.cpp": 4734, "HF": 3057},
    "gpt-oss-20b b1": {"roofline": 1145, "torch_runner": 473.8, "llama.cpp": 294, "HF": 0},
    "gpt-oss-20b b64": {"roofline": 21246, "torch_runner": 4838.6, "llama.cpp": 2427, "HF": 0},
}

# One NVIDIA H200, streaming HTTP serving (docs/performance.md, "Serving on the H200";
# tools/bench_serving.py --input-len 32 256 --output-len 32 128 --num-prompts 64 --seed 0
# --concurrency 1 16 64), random bf16 weights, the real Llama-3 tokenizer. Ours: main fc57965 with
# start-up graph capture (1B: the lower of two runs, 2026-12-03 17:18; 8B: 17:24); llama-server:
# 2026-12-03 16:55-17:00, same GPU, same weights as GGUF. (output tok/s, ITL p50 ms)
SERVING = {
    "1B c1": {"torch_runner": (758.9, 0.974), "llama-server": (479.2, 1.798)},
    "1B c16": {"torch_runner": (2722.4, 1.899), "llama-server": (715.4, 19.919)},
    "1B c64": {"torch_runner": (7426.7, 4.892), "llama-server": (829.3, 46.996)},
    "8B c1": {"torch_runner": (212.2, 4.225), "llama-server": (170.1, 5.348)},
    "8B c16": {"torch_runner": (1294.6, 4.866), "llama-server": (383.0, 35.644)},
    "8B c64": {"torch_runner": (4557.9, 5.286), "llama-server": (443.0, 84.644)},
}


def grouped_bars(data: dict, title: str, ylabel: str, path: Path, log: bool = False) -> None:
    groups = list(data)
    series = list(next(iter(data.values())))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, name in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [data[g][name] for g in groups], width, label=name)
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    grouped_bars(
        CPU,
        "SmolLM2-135M batch-1 decode, 2-core Intel Xeon (AVX-512 BF16 / VNNI)",
        "tokens/s",
        OUT / "cpu_batch1_decode.png",
    )
    grouped_bars(H200, "Decode on one H200, bf16", "tokens/s (log)", OUT / "h200_decode.png", True)
    for i, (what, name) in enumerate(
        (("output tokens/s (log)", "throughput"), ("ITL p50 ms (log)", "itl"))
    ):
        data = {g: {k: v[i] for k, v in row.items()} for g, row in SERVING.items()}
        title = f"Streaming serving on one H200, bf16: {name} (Llama-3.2-1B / 3.1-8B geometries)"
        grouped_bars(data, title, what, OUT / f"h200_serving_{name}.png", True)


if __name__ == "__main__":
    main()
