"""Benchmark what one Torch <-> MLX crossing costs, against tensor size (1 KB .. 256 MB).

Every MLX-substituted op pays a crossing, so this is the price list ops are judged against.
For each float32 payload size it times, interleaved on the same tensors:

  torch_clone     torch `t.clone()`: one memcpy of the payload (the copy-cost yardstick)
  import          `bridge.torch_to_mlx(t)`: owned, evaluated MLX copy
  export          `bridge.mlx_to_torch(a)` of an evaluated MLX array (zero-copy on CPU)
  raw_roundtrip   `torch.from_dlpack(mx.asarray(t))` + eval, no bridge: the floor (no checks, no
                  lock, no stride guard, no counters)
  call_identity   `bridge.mlx_call(lambda a: a, t)`: fence + import + eval + export
  torch_rms_norm  `F.rms_norm(x, (H,), w)` in torch, x = the payload as [rows, H], H <= 4096
  mlx_rms_norm    `mx.fast.rms_norm` + `mx.eval` on MLX copies of x, w (no crossing: the kernel)
  call_rms_norm   `bridge.mlx_call(mx.fast.rms_norm, x, w, eps)` on the same x, w

Within one size the methods run in forward order on even repeats and reverse order on odd
rounds (the machine is shared: both orders, interleaved, call by call). Small payloads get more
rounds (`--repeats` x min(30, `--sample-mb` / size)). Reported: median and mean of single calls
(the mean carries the scheduler tail: MLX evaluates on its own worker thread, which a loaded
machine wakes late).
Copy counts and bytes copied per call come from `bridge.stats()` (reset around each call).
Prints a markdown table: median microseconds, ratio to torch_clone (to torch_rms_norm for the
two rms_norm rows), copies/evals/fences per call, and effective GB/s over the payload.
call_rms_norm minus mlx_rms_norm is what the crossing adds to the kernel.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bridge  # noqa: E402

METHODS = (
    "torch_clone",
    "import",
    "export",
    "raw_roundtrip",
    "call_identity",
    "torch_rms_norm",
    "mlx_rms_norm",
    "call_rms_norm",
)


def sizes_bytes(min_kb: int, max_mb: int) -> list[int]:
    """Powers of four from min_kb KiB up to max_mb MiB."""
    sizes, size = [], min_kb * 1024
    while size <= max_mb * 1024 * 1024:
        sizes.append(size)
        size *= 4
    return sizes


def raw_roundtrip(t: torch.Tensor, mx) -> torch.Tensor:
    array = mx.asarray(t)
    mx.eval(array)
    return torch.from_dlpack(array)


def build_cases(nbytes: int, mx):
    numel = nbytes // 4
    hidden = min(4096, numel)
    t = torch.randn(numel)
    x = t.view(numel // hidden, hidden)  # [rows, H]
    w = torch.rand(hidden) + 0.5
    a = mx.random.normal((numel,))
    mx.eval(a)
    xa, wa = mx.array(x.numpy()), mx.array(w.numpy())
    mx.eval(xa, wa)
    eps = 1e-6
    return {
        "torch_clone": lambda: t.clone(),
        "import": lambda: bridge.torch_to_mlx(t),
        "export": lambda: bridge.mlx_to_torch(a, "cpu"),
        "raw_roundtrip": lambda: raw_roundtrip(t, mx),
        "call_identity": lambda: bridge.mlx_call(lambda v: v, t),
        "torch_rms_norm": lambda: torch.nn.functional.rms_norm(x, (hidden,), w, eps),
        "mlx_rms_norm": lambda: mx.eval(mx.fast.rms_norm(xa, wa, eps)),
        "call_rms_norm": lambda: bridge.mlx_call(mx.fast.rms_norm, x, w, eps),
    }


def time_call(fn) -> tuple[float, bridge.BridgeStats]:
    bridge.reset_stats()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return elapsed, bridge.stats()


def bench_size(nbytes: int, rounds: int, mx) -> dict[str, tuple[float, float, bridge.BridgeStats]]:
    """(median s, mean s, counters of one call) per method over `rounds` interleaved rounds."""
    cases = build_cases(nbytes, mx)
    for fn in cases.values():  # warm-up: first-touch page faults, MLX kernel setup
        fn()
    samples: dict[str, list[float]] = {m: [] for m in METHODS}
    counters: dict[str, bridge.BridgeStats] = {}
    for r in range(rounds):
        order = METHODS if r % 2 == 0 else tuple(reversed(METHODS))
        for m in order:
            seconds, counters[m] = time_call(cases[m])
            samples[m].append(seconds)
    return {m: (statistics.median(v), statistics.fmean(v), counters[m]) for m, v in samples.items()}


def rounds_for(nbytes: int, repeats: int, sample_bytes: int) -> int:
    """Small payloads get more rounds (up to 30x `repeats`) so their medians settle."""
    return repeats * max(1, min(30, sample_bytes // nbytes))


def fmt_size(nbytes: int) -> str:
    return f"{nbytes // (1024 * 1024)} MB" if nbytes >= 1024 * 1024 else f"{nbytes // 1024} KB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--min-kb", type=int, default=1, help="smallest payload in KiB (default 1)")
    parser.add_argument(
        "--max-mb", type=int, default=256, help="largest payload in MiB (default 256)"
    )
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed repeats per method and size (default 7)"
    )
    parser.add_argument(
        "--sample-mb",
        type=int,
        default=8,
        help="payloads under this many MiB get more rounds: repeats x min(30, sample / size) (default 8)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 0 leaves torch's default (default 1: Linux MLX CPU kernels "
        "are single-threaded, and a 2-thread torch pool thrashes on a shared machine)",
    )
    args = parser.parse_args(argv)
    if min(args.min_kb, args.max_mb, args.repeats, args.sample_mb) < 1:
        parser.error("--min-kb, --max-mb, --repeats and --sample-mb must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    import mlx.core as mx

    caps = bridge.capabilities()["cpu"]
    print(
        f"# bridge crossing cost: {platform.machine()} {sys.platform}, torch {torch.__version__}, "
        f"MLX {mx.__version__}, torch threads {torch.get_num_threads()}, repeats {args.repeats}, "
        f"sample {args.sample_mb} MiB\n"
        f"# cpu capabilities: import_zero_copy={caps.import_zero_copy}, "
        f"export_zero_copy={caps.export_zero_copy}, fence={caps.fence}\n"
    )
    print(
        "| size | rounds | method | median us | mean us | ratio | copies | bytes copied "
        "| evals | fences | GB/s |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for nbytes in sizes_bytes(args.min_kb, args.max_mb):
        rounds = rounds_for(nbytes, args.repeats, args.sample_mb * 1024 * 1024)
        results = bench_size(nbytes, rounds, mx)
        for m in METHODS:
            seconds, mean, s = results[m]
            base = results["torch_rms_norm" if "rms_norm" in m else "torch_clone"][0]
            print(
                f"| {fmt_size(nbytes)} | {rounds} | {m} | {seconds * 1e6:.1f} | {mean * 1e6:.1f} "
                f"| {seconds / base:.2f} | "
                f"{s.copies} | {s.bytes_copied} | {s.evals} | {s.fences} | "
                f"{nbytes / seconds / 1e9:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
