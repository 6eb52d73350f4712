"""One-row bf16 matmul (decode GEMV) speed at the Llama-1B / 8B layer shapes on CUDA: cuBLAS
(`F.linear`) against a Triton split-K GEMV, CUDA-graph timed, weights rotated past the L2.

Prints one JSON row per shape: microseconds and TB/s of weight bytes for both, and the best of
the Triton tile configurations tried (BLOCK_N, BLOCK_K, SPLIT_K). Measured on the H200 on
2026-12-02 (docs/performance-log.md): cuBLAS reaches 1.4-2.4 TB/s on the 1B's small matrices;
this Triton kernel was 10-25% slower than cuBLAS at every shape.

    PYTHONPATH=. python tools/bench_gemv.py
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"1b_qkv": (3072, 2048), "1b_o": (2048, 2048), "1b_gu": (16384, 2048),
          "1b_down": (2048, 8192), "1b_head": (128256, 2048), "8b_qkv": (6144, 4096),
          "8b_o": (4096, 4096), "8b_gu": (28672, 4096), "8b_down": (4096, 14336),
          "8b_head": (128256, 4096)}  # fmt: skip
CONFIGS = ((16, 512, 1), (32, 256, 1), (16, 256, 4), (8, 512, 2))  # BLOCK_N, BLOCK_K, SPLIT_K


@triton.jit
def _gemv_kernel(X, W, Y, N, K, swn, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                 KPER: tl.constexpr):  # fmt: skip
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * KPER
    acc = tl.zeros([BN], tl.float32)
    for kk in range(0, KPER, BK):
        k = k0 + kk + tl.arange(0, BK)
        w = tl.load(W + n[:, None] * swn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                    other=0.0)  # fmt: skip
        x = tl.load(X + k, mask=k < K, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    if SPLIT == 1:
        tl.store(Y + n, acc.to(Y.dtype.element_ty), mask=n < N)
    else:
        tl.atomic_add(Y + n, acc, mask=n < N, sem="relaxed")


def gemv(x: torch.Tensor, w: torch.Tensor, bn: int, bk: int, split: int) -> torch.Tensor:
    """x [1, K] @ w[N, K].T -> [1, N] in x's dtype (fp32 atomics across SPLIT_K programs)."""
    n, k = w.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device) if split == 1 else torch.zeros(
        n, dtype=torch.float32, device=x.device)  # fmt: skip
    _gemv_kernel[(triton.cdiv(n, bn), split)](x, w, y, n, k, w.stride(0), BN=bn, BK=bk,
                                              SPLIT=split, KPER=triton.cdiv(k, split * bk) * bk,
                                              num_warps=4)  # fmt: skip
    return y.to(x.dtype)[None]


def graph_time_us(fn, reps: int = 50) -> float:
    """Median over 5 replays of a graph of `reps` calls, per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps * 1e3)
    return sorted(times)[2]


def rotating(weights, call):
    """A closure calling `call(weight)` on the next of `weights` each time."""
    state = [0]

    def run():
        state[0] = (state[0] + 1) % len(weights)
        return call(weights[state[0]])

    return run


def main() -> None:
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                   for _ in range(max(1, int(6e8 // (n * k * 2))))]  # fmt: skip
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), weights[0].float())
        t_cublas = graph_time_us(rotating(weights, lambda w, x=x: F.linear(x, w)))
        best = None
        for bn, bk, split in CONFIGS:
            err = (gemv(x, weights[0], bn, bk, split).float() - ref).norm() / ref.norm()
            if err > 1e-2:
                raise RuntimeError(f"{name} {bn, bk, split}: relative error {err:.2e}")
            t = graph_time_us(rotating(weights, lambda w, x=x, c=(bn, bk, split): gemv(x, w, *c)))
            best = min(best or (t, bn, bk, split), (t, bn, bk, split))
        gb = n * k * 2 / 1e9
        print(json.dumps(dict(shape=name, cublas_us=round(t_cublas, 2),
                              cublas_tbs=round(gb / t_cublas * 1e3, 2),
                              triton_us=round(best[0], 2), triton_tbs=round(gb / best[0] * 1e3, 2),
                              config=best[1:])), flush=True)  # fmt: skip
        del weights


if __name__ == "__main__":
    main()
