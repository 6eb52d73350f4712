"""Per-step host / device timing of an Engine's decode loop (bench_cuda_decode.py --step-trace).

Wraps one engine's `_launch` and `_postprocess` (instance attributes, nothing else changes) and
records, per `Engine.step`: host time scheduling + launching, time blocked reading the previous
step's tokens, host time postprocessing, and on the device (CUDA events around each launch) the
launch's span and the idle gap before it. A window whose steps are slow with long `gap_ms` is
host-bound; one with long `span_ms` and short gaps is device-bound.
"""

from __future__ import annotations

import statistics
import time

import torch


class StepTrace:
    def __init__(self, engine):
        self.steps: list[dict] = []
        self._current: dict | None = None
        launch, postprocess = engine._launch, engine._postprocess

        def timed_launch():
            t0 = time.perf_counter()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            launched = launch()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            if self._current is not None:
                self._current["launch"] += time.perf_counter() - t0
                self._current["events"].append((start, end))
            return launched

        def timed_postprocess(launched):
            t0 = time.perf_counter()
            launched.result()
            t1 = time.perf_counter()
            outputs = postprocess(launched)
            if self._current is not None:
                self._current["wait"] += t1 - t0
                self._current["post"] += time.perf_counter() - t1
            return outputs

        engine._launch, engine._postprocess = timed_launch, timed_postprocess

    def begin(self) -> None:
        self._current = dict(launch=0.0, wait=0.0, post=0.0, events=[], t0=time.perf_counter())

    def end(self, in_window: bool) -> None:
        step, self._current = self._current, None
        step["wall"] = time.perf_counter() - step.pop("t0")
        step["in_window"] = in_window
        self.steps.append(step)

    def summary(self) -> dict:
        """Medians / p90 / max over the window's steps (ms); clears the record. Call after a
        device sync."""
        window = [s for s in self.steps if s["in_window"]]
        events = [e for s in self.steps for e in s["events"]]
        spans, gaps = {}, {}
        for i, (start, end) in enumerate(events):
            spans[id(start)] = start.elapsed_time(end)
            if i:
                gaps[id(start)] = max(events[i - 1][1].elapsed_time(start), 0.0)
        rows = {
            "wall_ms": [s["wall"] * 1e3 for s in window],
            "launch_ms": [s["launch"] * 1e3 for s in window],
            "wait_ms": [s["wait"] * 1e3 for s in window],
            "post_ms": [s["post"] * 1e3 for s in window],
            "span_ms": [spans[id(e[0])] for s in window for e in s["events"]],
            "gap_ms": [gaps.get(id(e[0]), 0.0) for s in window for e in s["events"]],
        }
        self.steps = []
        out = {"window_steps": len(window)}
        for name, values in rows.items():
            if values:
                values = sorted(values)
                out[name] = [round(statistics.median(values), 3),
                             round(values[int(0.9 * (len(values) - 1))], 3),
                             round(values[-1], 3)]  # fmt: skip
        return out
