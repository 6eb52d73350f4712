"""tools/kernel_trace.py: a trace built here with known kernels per step gives back, per step,
the busy time, each GEMV position's time and count, and the lm_head as the tail (the oracle is
the trace's own construction)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "kernel_trace.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("kernel_trace", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_positions_busy_and_tail_per_step():
    layer = [("norm", 1.0), ("_gemv_rows_0", 4.0), ("attn", 2.0), ("_gemv_rows_0", 3.0),
             ("add_norm", 1.0), ("_gemv_rows_0", 9.0), ("_gemv_rows_0", 6.0)]  # fmt: skip
    steps, layers, kernels, t = 3, 2, [], 0.0
    for _ in range(steps):
        for _ in range(layers):
            for name, dur in layer:
                kernels.append([name, t, dur])
                t += dur + 0.5
        kernels.append(["_gemv_rows_0", t, 40.0])
        t += 41.0
    s = _load_tool().summarize(dict(steps=steps, kernels=kernels), "gemv", 4, layers)
    assert s["busy_us"] == layers * sum(d for _, d in layer) + 40.0
    assert s["matches_per_step"] == 4 * layers + 1
    assert s["positions"] == {"0": (4.0, 2), "1": (3.0, 2), "2": (9.0, 2), "3": (6.0, 2),
                              "tail": (40.0, 1)}  # fmt: skip
    assert abs(s["by_name"]["attn"] - 2.0 * layers) < 1e-9
    derived = _load_tool().summarize(dict(steps=steps, kernels=kernels), "gemv", 4)
    assert derived["positions"] == s["positions"]  # layers from the matches per step
