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

# 2026-12-01 21:41 UTC, 2-core Intel Xeon (AVX-512 BF16, AMX), SmolLM2-135M batch-1 decode tok/s,
# medians of 3 interleaved rounds (docs/performance.md, CPU table; bf16 activations for int8/int4).
CPU = {
    "fp32": {"torch_runner": 25.8, "llama.cpp": 40.5},
    "bf16": {"torch_runner": 40.0, "llama.cpp": 59.0},
    "int8 / q8_0": {"torch_runner": 51.3, "llama.cpp": 75.3},
    "int4 / Q4_1": {"torch_runner": 79.5, "llama.cpp": 88.5},
}

# 2026-12-01, one NVIDIA H200, bf16 random weights, prompt 128 + 128 generated, decode tok/s
# (docs/performance.md, H200 table: tools/bench_cuda_decode.py; llama.cpp and HF from the earlier
# session's table).
H200 = {
    "Llama-3.2-1B b1": {"roofline": 1715, "torch_runner": 530, "llama.cpp": 746, "HF": 108},
    "Llama-3.2-1B b64": {"roofline": 94632, "torch_runner": 18329, "llama.cpp": 9571, "HF": 5277},
    "Llama-3.1-8B b1": {"roofline": 283, "torch_runner": 167.5, "llama.cpp": 205, "HF": 48},
    "Llama-3.1-8B b64": {"roofline": 16365, "torch_runner": 6570, "llama.cpp": 4734, "HF": 3057},
    "gpt-oss-20b b1": {"roofline": 588, "torch_runner": 153, "llama.cpp": 294, "HF": 0},
    "gpt-oss-20b b64": {"roofline": 6615, "torch_runner": 3149, "llama.cpp": 2427, "HF": 0},
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
        "SmolLM2-135M batch-1 decode, 2-core Xeon",
        "tokens/s",
        OUT / "cpu_batch1_decode.png",
    )
    grouped_bars(H200, "Decode on one H200, bf16", "tokens/s (log)", OUT / "h200_decode.png", True)


if __name__ == "__main__":
    main()
