"""Denoise-step time of a tiny diffusers Flux pipeline: unpatched, patched-torch, patched-MLX.

All configurations run side by side in one process on one pipeline object (patch / unpatch
between runs), interleaved round by round, alternating forward and reverse order, so machine
load drifts hit them alike. A step's time is the gap between two consecutive step-end callbacks
(the first step of each run, which includes set-up, is dropped), measured twice: process CPU
time (all threads; robust when the box is oversubscribed, since time spent descheduled is not
counted) and wall time. Prints a markdown table of medians and ratios to unpatched, per order
and overall, plus bridge crossings (mx.eval calls) per step for MLX, then a per-call table of
each op (torch reference vs MLX variant) at the pipeline's shapes.

MLX is enabled inside this process (TORCH_RUNNER_USE_MLX=1) before ops is imported, so patched-MLX
can be compared with the others in the same run; --no-mlx skips it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = ("unpatched", "patched-torch", "patched-mlx")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="rounds; each runs every config once, order alternating (default 6)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=6,
        help="denoise steps per pipeline run; the first is dropped (default 6)",
    )
    parser.add_argument(
        "--layers", type=int, default=2, help="Flux double-stream blocks (default 2)"
    )
    parser.add_argument(
        "--single-layers", type=int, default=2, help="Flux single-stream blocks (default 2)"
    )
    parser.add_argument("--heads", type=int, default=2, help="attention heads (default 2)")
    parser.add_argument(
        "--head-dim", type=int, default=16, help="head dim, a multiple of 4 (default 16)"
    )
    parser.add_argument(
        "--size", type=int, default=32, help="image height = width in pixels, even (default 32)"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="pipeline dtype (default fp32)"
    )

    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared, oversubscribed box torch's spinning "
        "thread pool makes 2-thread timings swing 2-10x); 0 keeps torch's default",
    )
    parser.add_argument("--no-mlx", action="store_true", help="skip patched-mlx (no MLX import)")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.steps < 2:
        parser.error("--rounds and --steps must be >= 2 (both orders; the first step is dropped)")
    if args.size % 2:
        parser.error(f"--size must be even; got {args.size}")
    return args


def time_steps(pipe, prompt, args, torch) -> list[tuple[float, float]]:
    """Run the pipeline once; return (cpu s, wall s) of each denoise step except the first."""
    stamps: list[tuple[float, float]] = []

    def on_step_end(_pipe, _step, _timestep, kwargs):
        stamps.append((time.process_time(), time.perf_counter()))
        return kwargs

    with torch.no_grad():
        pipe(
            **prompt,
            height=args.size,
            width=args.size,
            num_inference_steps=args.steps,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
            callback_on_step_end=on_step_end,
        )
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(stamps, stamps[1:])]


def median_ms(samples: list[tuple[float, float]], which: int) -> float:
    return statistics.median(sample[which] for sample in samples) * 1e3


def op_table(args, torch) -> None:
    """Per-call cost of each op, torch reference vs MLX variant, at this pipeline's shapes."""
    from ops.diffusion import dit_rope, modulate, norm_infer
    from ops.diffusion import mlx as mlx_ops

    dtype = getattr(torch, DTYPES[args.dtype])
    tokens, width = (args.size // 2) ** 2, args.heads * args.head_dim
    x = torch.randn(1, tokens, width).to(dtype)  # [B, N, D]
    q = torch.randn(1, tokens, args.heads, args.head_dim).to(dtype)  # [B, S, H, Dh]
    weight, shift, scale = torch.ones(args.head_dim), torch.randn(1, width), torch.randn(1, width)
    cos, sin = torch.rand(tokens, args.head_dim), torch.rand(tokens, args.head_dim)
    cases = {
        f"norm_infer layer [1, {tokens}, {width}]": lambda f: f(x, None, None, 1e-6, False),
        f"norm_infer rms+weight [1, {tokens}, {args.heads}, {args.head_dim}]": lambda f: f(
            q, weight, None, 1e-6, True
        ),
        f"modulate [1, {tokens}, {width}]": lambda f: f(x, shift.to(dtype), scale.to(dtype)),
        f"dit_rope [1, {tokens}, {args.heads}, {args.head_dim}]": lambda f: f(q, cos, sin, True, 1),
    }
    impls = {
        "torch": {"norm_infer": norm_infer, "modulate": modulate, "dit_rope": dit_rope},
        "mlx": {
            "norm_infer": mlx_ops.norm_infer,
            "modulate": mlx_ops.modulate,
            "dit_rope": mlx_ops.dit_rope,
        },
    }
    print(f"\nPer call, {args.dtype}, median of {args.rounds} rounds x 50 calls, both orders:\n")
    print("| op | torch CPU us | MLX CPU us | MLX/torch CPU | torch wall us | MLX wall us |")
    print("|---|---|---|---|---|---|")
    for label, call in cases.items():
        name = label.split()[0]
        samples = {"torch": [], "mlx": []}
        for round_index in range(args.rounds):
            for backend in ("torch", "mlx") if round_index % 2 == 0 else ("mlx", "torch"):
                fn = impls[backend][name]
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(50):
                    call(fn)
                samples[backend].append(
                    ((time.process_time() - cpu) / 50, (time.perf_counter() - wall) / 50)
                )
        t_cpu, m_cpu = (median_ms(samples[b], 0) * 1e3 for b in ("torch", "mlx"))
        t_wall, m_wall = (median_ms(samples[b], 1) * 1e3 for b in ("torch", "mlx"))
        print(
            f"| {label} | {t_cpu:.1f} | {m_cpu:.1f} | {m_cpu / t_cpu:.2f} | {t_wall:.1f} | {m_wall:.1f} |"
        )


def main(argv=None) -> None:
    args = parse_args(argv)
    configs = CONFIGS[:2] if args.no_mlx else CONFIGS
    if not args.no_mlx:
        os.environ["TORCH_RUNNER_USE_MLX"] = "1"
    import torch

    import bridge
    from ops.diffusion import patch, unpatch
    from ops.diffusion.tiny import tiny_flux_pipeline, tiny_flux_prompt

    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = tiny_flux_pipeline(args.layers, args.single_layers, args.heads, args.head_dim)
    pipe.to(getattr(torch, DTYPES[args.dtype]))
    prompt = tiny_flux_prompt(pipe)

    def run(config: str) -> list[float]:
        if config != "unpatched":
            patch(pipe.transformer, backend=config.removeprefix("patched-"))
        try:
            return time_steps(pipe, prompt, args, torch)
        finally:
            unpatch(pipe.transformer)

    for config in configs:  # warm-up: first calls pay lazy imports and allocator growth
        run(config)
    per_order = {(c, o): [] for c in configs for o in ("forward", "reverse")}
    for round_index in range(args.rounds):
        order = "forward" if round_index % 2 == 0 else "reverse"
        for config in configs if order == "forward" else reversed(configs):
            per_order[(config, order)] += run(config)

    crossings = None
    if not args.no_mlx:
        patch(pipe.transformer, backend="mlx")
        bridge.reset_stats()
        time_steps(pipe, prompt, args, torch)
        crossings = bridge.stats().evals / args.steps
        unpatch(pipe.transformer)

    width = args.heads * args.head_dim
    tokens = (args.size // 2) ** 2
    print(
        f"Flux tiny pipeline: {args.layers}+{args.single_layers} blocks, width {width}, {tokens} image "
        f"tokens, {args.dtype}, {args.steps} steps x {args.rounds} rounds, torch threads "
        f"{torch.get_num_threads()}\n"
    )
    print(
        "| config | CPU ms/step | CPU fwd / rev order | CPU ratio | wall ms/step | "
        "wall fwd / rev order | wall ratio | MLX crossings/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    both = {c: per_order[(c, "forward")] + per_order[(c, "reverse")] for c in configs}
    for config in configs:
        cells = [config]
        for which in (0, 1):
            med = median_ms(both[config], which)
            fwd = median_ms(per_order[(config, "forward")], which)
            rev = median_ms(per_order[(config, "reverse")], which)
            ratio = med / median_ms(both["unpatched"], which)
            cells += [f"{med:.2f}", f"{fwd:.2f} / {rev:.2f}", f"{ratio:.3f}"]
        cells.append(f"{crossings:.0f}" if config == "patched-mlx" else "0")
        print("| " + " | ".join(cells) + " |")
    if not args.no_mlx:
        op_table(args, torch)


if __name__ == "__main__":
    main()
