"""Tensor parallel on the CPU: decode tokens/s and per-step all-reduce time at tp 1 and 2.

One Llama geometry with dummy weights (hidden 1024, 8 layers, 16 heads / 8 KV heads, head_dim 64,
intermediate 2816, vocab 32000, fp32), one engine per tensor-parallel size, alive side by side and
run alternately (`--repeats` rounds, medians). The same cores either way: tp 1 runs with
`--threads` intra-op threads, tp 2 with threads/2 per rank (spawned workers, gloo). tp 1 keeps its
CPU decode fast path (FlatDecoder); under tp it is off (the all-reduces are module hooks).
All-reduce time is rank 0's wall time inside `dist.all_reduce` per engine step (every layer's
two, plus the vocab-parallel embedding's), and the logits gather is not in it.

    .venv/bin/python tools/bench_tp.py --batches 1,8 --gen-len 32 --repeats 3

`--rss`: peak resident memory per rank instead. It writes a random bf16 checkpoint of a ~317M
parameter Llama geometry (RSS_GEOMETRY, 634 MB), then loads it at tp 1 and at tp 2 (two ranks
started with RANK/WORLD_SIZE as torchrun does) and runs one short request; each rank prints its
own `resource.getrusage` max RSS (mapped file pages included) and its peak anonymous RSS
(RssAnon sampled every 2 ms), both as growth over the process before the engine started
(Python, torch, the tokenizer), and what it holds while serving (RSS, anonymous, file pages).

    PYTHONPATH=. .venv/bin/python tools/bench_tp.py --rss
    PYTHONPATH=. .venv/bin/python tools/bench_tp.py --rss --rss-geometry qwen3_moe
    PYTHONPATH=. .venv/bin/python tools/bench_tp.py --rss --rss-geometry qwen3_moe --expert-parallel

(PYTHONPATH=.: a script's own folder, not the cwd, leads sys.path, so without it this process
and its ranks import the installed checkout instead of this one.)

`--rss-geometry qwen3_moe` writes a random Qwen3-MoE (MOE_RSS_GEOMETRY, 584 MB) whose experts are
one tensor per expert and projection, as on the Hub (stacked into [E, ...] at load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from models.default_model import default_model_path
from torch_runner import Engine, SamplingParams

GEOMETRY = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=1024,
    intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
    head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, torch_dtype="float32",
)  # fmt: skip


RSS_GEOMETRY = {**GEOMETRY, "num_hidden_layers": 16, "intermediate_size": 4096,
                "torch_dtype": "bfloat16"}  # fmt: skip
# --rss-geometry qwen3_moe: 16 experts of 512 per layer, written as the Hub lays them out (one
# tensor per expert and projection, stacked at load); 292M parameters, experts 69% of them
MOE_RSS_GEOMETRY = {**RSS_GEOMETRY, "model_type": "qwen3_moe", "num_hidden_layers": 8,
                    "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 16,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 512,
                    "norm_topk_prob": True}  # fmt: skip
RSS_GEOMETRIES = {"llama": RSS_GEOMETRY, "qwen3_moe": MOE_RSS_GEOMETRY}


def hub_layout(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stacked Qwen3-MoE expert tensor as the Hub stores it (one tensor per expert)."""
    prefix, _, leaf = name.rpartition(".")
    if leaf == "gate_up_proj":  # [E, 2I, H]: gate rows, then up
        inter = tensor.shape[1] // 2
        return {f"{prefix}.{e}.{proj}.weight": part.clone() for e in range(tensor.shape[0])
                for proj, part in (("gate_proj", tensor[e, :inter]), ("up_proj", tensor[e, inter:]))}  # fmt: skip
    if leaf == "down_proj" and prefix.endswith(".experts"):  # [E, H, I]
        return {f"{prefix}.{e}.down_proj.weight": tensor[e].clone() for e in range(tensor.shape[0])}
    return {name: tensor}


def write_random_checkpoint(directory: Path, geometry: str = "llama") -> int:
    """RSS_GEOMETRIES[geometry]'s tensors, N(0, 0.02) in bf16 (norms 1), MoE experts in the Hub
    layout; returns the bytes written."""
    from safetensors.torch import save_file

    from models.loader import _hf_config
    from models.registry import get_family

    config = RSS_GEOMETRIES[geometry]
    (directory / "config.json").write_text(json.dumps(config))
    family = get_family(config["model_type"])
    with torch.device("meta"):
        model = family.Model(family.ModelArgs.from_hf_config(_hf_config(directory)))
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, t in model.state_dict().items():
        if "norm" in name:
            tensors[name] = torch.ones(t.shape, dtype=torch.bfloat16)
        else:
            value = (torch.randn(t.shape, generator=generator) * 0.02).to(torch.bfloat16)
            tensors |= hub_layout(name, value)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.nbytes for t in tensors.values())


def proc_status_mb() -> dict[str, float]:
    """This process's VmRSS / RssAnon / RssFile now, in MiB (Linux /proc/self/status)."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024  # kB
    return out


class AnonPeak:
    """The peak of RssAnon (anonymous resident memory: what the process itself holds, without
    mapped file pages), sampled every `period` seconds on a daemon thread; the kernel keeps only
    the peak of the total (VmHWM / ru_maxrss)."""

    def __init__(self, period: float = 0.002):
        import threading

        self.peak = proc_status_mb()["RssAnon"]
        self.period = period
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, proc_status_mb()["RssAnon"])
            time.sleep(self.period)


def rss_child(directory: str, expert_parallel: bool = False) -> None:
    """One rank of the --rss run (RANK set: a torchrun-style rank; else tp 1)."""
    import atexit
    import resource
    import sys

    def max_rss_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    from transformers import AutoConfig, AutoTokenizer

    AutoTokenizer.from_pretrained(default_model_path())  # what any engine loads besides weights
    AutoConfig.from_pretrained(directory)
    base, base_anon = max_rss_mb(), proc_status_mb()["RssAnon"]
    anon = AnonPeak()
    rank = int(os.environ.get("RANK", 0))
    end = {}

    def report() -> None:
        print(json.dumps({"rank": rank, "base_mb": base, "peak_mb": max_rss_mb(),
                          "base_anon_mb": base_anon, "peak_anon_mb": anon.peak,
                          "end_mb": end.get("VmRSS"), "end_anon_mb": end.get("RssAnon"),
                          "end_file_mb": end.get("RssFile")}), flush=True)  # fmt: skip

    atexit.register(report)
    from torch_runner.runner.model_runner import ModelRunner

    forward = ModelRunner.forward_logits

    def serving(self, *args, **kwargs):  # every rank runs each step: what it holds while serving
        out = forward(self, *args, **kwargs)
        end.update(proc_status_mb())
        return out

    ModelRunner.forward_logits = serving
    size = int(os.environ.get("WORLD_SIZE", 1))
    engine = Engine(directory, device="cpu", dtype="auto", max_total_tokens=256,
                    tokenizer=str(default_model_path()), tensor_parallel_size=size,
                    enable_expert_parallel=expert_parallel and size > 1)  # fmt: skip
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0))
    engine.close()
    sys.exit(0)


def _rss_rounds(directory: Path, threads: int, repeats: int, geometry: str, ep: bool):
    import subprocess
    import sys

    from torch_runner.distributed.group import free_port

    # written by a child: a process starts with its parent's max RSS (Linux keeps it over exec)
    written = subprocess.run([sys.executable, __file__, "--rss-write", str(directory),
                              "--rss-geometry", geometry],
                             capture_output=True, text=True, check=True)  # fmt: skip
    nbytes = int(written.stdout.split()[-1])
    print(f"bench_tp --rss: random {geometry}, {nbytes / 2**20:.0f} MiB of bf16 weights"
          + (", tp 2 expert parallel" if ep else ""))  # fmt: skip
    base_env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    runs: dict[tuple[int, int], list[dict]] = {}
    for size in (1, 2) * repeats:
        env = dict(base_env)
        if size > 1:
            env |= {"WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(free_port())}  # fmt: skip
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--rss-child", str(directory)]
                + (["--expert-parallel"] if ep else []),
                env=env | ({"RANK": str(r), "LOCAL_RANK": str(r)} if size > 1 else {}),
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for r in range(size)
        ]
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            report = json.loads(out.strip().splitlines()[-1])
            runs.setdefault((size, report["rank"]), []).append(report)
    return nbytes, runs


def rss_run(threads: int, repeats: int, geometry: str, ep: bool) -> None:
    directory = Path(tempfile.mkdtemp(prefix="bench_tp_rss_"))
    try:
        nbytes, runs = _rss_rounds(directory, threads, repeats, geometry, ep)
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # the 634 MB checkpoint
    weights_mb = nbytes / 2**20
    for (size, rank), reports in sorted(runs.items()):
        med = {k: statistics.median(r[k] for r in reports) for k in reports[0] if k != "rank"}
        grow, grow_anon = med["peak_mb"] - med["base_mb"], med["peak_anon_mb"] - med["base_anon_mb"]
        print(f"tp {size} rank {rank}: peak RSS +{grow:.0f} MiB ({grow / weights_mb:.2f} x the "
              f"weights), peak anonymous +{grow_anon:.0f} MiB ({grow_anon / weights_mb:.2f} x); "
              f"serving: RSS +{med['end_mb'] - med['base_mb']:.0f} MiB, anonymous "
              f"+{med['end_anon_mb'] - med['base_anon_mb']:.0f}, file pages {med['end_file_mb']:.0f}"
              f" MiB (before loading: RSS {med['base_mb']:.0f}, anonymous "
              f"{med['base_anon_mb']:.0f} MiB), median of {len(reports)}")  # fmt: skip


class StepCounter:
    """Counts engine steps (to divide the all-reduce time per step)."""

    def __init__(self, engine: Engine):
        self.count, step = 0, engine.step

        def counted():
            self.count += 1
            return step()

        engine.step = counted


def run(engine: Engine, counter: StepCounter, threads: int, batch: int, args) -> dict:
    torch.set_num_threads(threads)
    prompts = [[(7 * i + j) % 31000 + 100 for j in range(args.prompt_len)] for i in range(batch)]
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    group = engine.tensor_parallel.group if engine.tensor_parallel else None
    if group is not None:
        group.timing, group.all_reduce_seconds = True, 0.0
    steps = counter.count
    start = time.perf_counter()
    engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    steps = counter.count - steps
    reduce_ms = 1e3 * group.all_reduce_seconds / steps if group is not None else 0.0
    return {"tok_s": batch * args.gen_len / seconds, "reduce_ms": reduce_ms, "steps": steps,
            "step_ms": 1e3 * seconds / steps}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds (median)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads in all")
    parser.add_argument("--rss", action="store_true", help="peak RSS per rank, tp 1 vs 2")
    parser.add_argument(
        "--rss-geometry",
        choices=sorted(RSS_GEOMETRIES),
        default="llama",
        help="--rss: the random checkpoint (qwen3_moe: Hub per-expert tensors)",
    )
    parser.add_argument(
        "--expert-parallel",
        action="store_true",
        help="--rss: tp 2 holds whole experts per rank (enable_expert_parallel)",
    )
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    parser.add_argument("--rss-write", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_write:
        return print(write_random_checkpoint(Path(args.rss_write), args.rss_geometry))
    if args.rss_child:
        return rss_child(args.rss_child, args.expert_parallel)
    if args.rss:
        return rss_run(max(1, args.threads // 2), args.repeats, args.rss_geometry,
                       args.expert_parallel)  # fmt: skip
    directory = Path(tempfile.mkdtemp(prefix="bench_tp_"))
    (directory / "config.json").write_text(json.dumps(GEOMETRY))
    common = dict(device="cpu", dtype="float32", load_format="dummy", max_total_tokens=8192,
                  tokenizer=str(default_model_path()), enable_prefix_caching=False)  # fmt: skip
    per_rank = max(1, args.threads // 2)
    torch.set_num_threads(args.threads)
    engines = {1: Engine(str(directory), **common)}
    torch.set_num_threads(per_rank)  # the spawned rank inherits it
    engines[2] = Engine(str(directory), tensor_parallel_size=2, **common)
    threads = {1: args.threads, 2: per_rank}
    counters = {tp: StepCounter(e) for tp, e in engines.items()}
    print(f"bench_tp: {json.dumps({k: GEOMETRY[k] for k in ('hidden_size', 'num_hidden_layers')})}"
          f" fp32 dummy, prompt {args.prompt_len}, gen {args.gen_len}, {args.repeats} rounds")  # fmt: skip
    try:
        for batch in (int(b) for b in args.batches.split(",")):
            for tp in engines:  # warm-up
                run(engines[tp], counters[tp], threads[tp], batch, args)
            results = {1: [], 2: []}
            for _ in range(args.repeats):
                for tp in engines:
                    results[tp].append(run(engines[tp], counters[tp], threads[tp], batch, args))
            med = {
                tp: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                for tp, rs in results.items()
            }
            print(f"batch {batch:3d}: tp1 {med[1]['tok_s']:7.1f} tok/s ({med[1]['step_ms']:.1f} "
                  f"ms/step) | tp2 {med[2]['tok_s']:7.1f} tok/s ({med[2]['step_ms']:.1f} ms/step, "
                  f"all-reduce {med[2]['reduce_ms']:.2f} ms/step) | tp2/tp1 "
                  f"{med[2]['tok_s'] / med[1]['tok_s']:.2f}x")  # fmt: skip
    finally:
        engines[2].close()


if __name__ == "__main__":
    main()
