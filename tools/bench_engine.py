"""Engine benchmark: offline throughput vs HF transformers `generate`, and SWA KV cost vs context.

Part 1 (`--batches`): the default model (or --model), B prompts of --prompt-len tokens, --gen-len
greedy tokens each. For every batch size both engines run side by side in one process,
alternating which goes first on every repeat (medians over --repeats). Reported per engine:
total throughput (generated tokens / wall time, prefill included) and decode tok/s (tokens
after the first / time after the first token). "HF one-at-a-time" is HF's batch-1 throughput,
i.e. what HF generate delivers to B concurrent clients served in turn.

Part 2 (`--swa-contexts`): an SWA geometry with dummy weights (--swa-layers layers alternating
sliding/full, window --window). A request is primed at each context length directly in the
caches (no prefill: decode cost depends on shapes, not values) and --swa-steps decode steps are
timed; beside it the same geometry with every layer full attention. Reports KV bytes held by
the SWA layers (constant in context), by the pool, and the decode step time.

    .venv/bin/python tools/bench_engine.py --batches 1,8,32,64 --swa-contexts 1024,4096,32768
    python tools/bench_engine.py --device cuda --dtype bfloat16 --compare-eager --swa-contexts ''
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ops.sampling.params import SamplingParams
from torch_runner import Engine
from torch_runner.kv.caches import WindowedKVCache
from torch_runner.request_state import RequestState
from torch_runner.sequence import Sequence, SequenceStatus


def _prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(100, vocab - 1, (prompt_len,), generator=gen).tolist() for _ in range(batch)
    ]


def run_engine(engine: Engine, prompts, gen_len: int) -> tuple[float, float]:
    """(total tok/s, decode tok/s) for one batch through the engine."""
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    rids = {engine.add_request(None, p, params) for p in prompts}
    t0 = time.perf_counter()
    started, t_first = set(), None
    while engine.has_unfinished():
        for out in engine.step():
            started.add(out.request_id)
        if t_first is None and started >= rids:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    n = len(prompts)
    return n * gen_len / (t_end - t0), n * (gen_len - 1) / max(t_end - t_first, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def run_hf(model, prompts, gen_len: int) -> tuple[float, float]:
    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, attention_mask=mask)
    _sync(model.device)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    _sync(model.device)
    t1 = time.perf_counter()
    model.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len, **kwargs)
    _sync(model.device)
    t2 = time.perf_counter()
    n = len(prompts)
    return n * gen_len / (t2 - t1), n * (gen_len - 1) / max((t2 - t1) - (t1 - t0), 1e-9)


def bench_throughput(args) -> None:
    from transformers import AutoModelForCausalLM

    def make_engine(enforce_eager: bool) -> Engine:
        return Engine(args.model, device=args.device, dtype=args.dtype, max_total_tokens=args.pool_tokens,
                      max_num_seqs=max(args.batches), enable_prefix_caching=False,
                      enforce_eager=enforce_eager, cuda_graph_max_bs=max(args.batches))  # fmt: skip

    engine = make_engine(False)
    eager = make_engine(True) if args.compare_eager else None
    hf = AutoModelForCausalLM.from_pretrained(
        engine.model_path, dtype=engine.dtype, attn_implementation="sdpa"
    ).to(engine.device)
    hf.eval()
    rows, hf_single = [], None
    for batch in args.batches:
        prompts = _prompts(batch, args.prompt_len, engine.vocab_size)
        ours, theirs, ours_eager = [], [], []
        runs = [(run_engine, engine, ours), (run_hf, hf, theirs)]
        if eager is not None:
            runs.insert(1, (run_engine, eager, ours_eager))
        for fn, target, _ in runs:  # warm-up: CUDA graph capture, allocator, kernel selection
            for _ in range(args.warmup):
                fn(target, prompts, args.gen_len)
        for r in range(args.repeats):
            for fn, target, sink in runs if r % 2 == 0 else runs[::-1]:
                sink.append(fn(target, prompts, args.gen_len))
        med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
        row = dict(batch=batch, ours_total=med(ours, 0), ours_decode=med(ours, 1),
                   hf_total=med(theirs, 0), hf_decode=med(theirs, 1))  # fmt: skip
        if eager is not None:
            row.update(eager_total=med(ours_eager, 0), eager_decode=med(ours_eager, 1))
        if batch == 1:
            hf_single = row["hf_total"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    where = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    print(f"\n{args.model or 'default model'} {engine.dtype} on {where}, prompt {args.prompt_len}, gen {args.gen_len}, "
          f"{torch.get_num_threads()} threads, medians of {args.repeats} (orders alternate)\n")  # fmt: skip
    print("| batch | ours total tok/s | HF batched total | ratio | ours decode tok/s | HF decode | ratio "
          "| vs HF one-at-a-time |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        vs_single = f"{r['ours_total'] / hf_single:.1f}x" if hf_single else "n/a"
        print(f"| {r['batch']} | {r['ours_total']:.1f} | {r['hf_total']:.1f} | {r['ours_total'] / r['hf_total']:.2f}x "
              f"| {r['ours_decode']:.1f} | {r['hf_decode']:.1f} | {r['ours_decode'] / r['hf_decode']:.2f}x "
              f"| {vs_single} |")  # fmt: skip
    if eager is not None:
        print("\n| batch | ours decode (graphs) | ours decode (--enforce-eager) | HF decode "
              "| graphs / HF | eager / HF | graphs / eager |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            g, e, h = r["ours_decode"], r["eager_decode"], r["hf_decode"]
            print(f"| {r['batch']} | {g:.1f} | {e:.1f} | {h:.1f} | {g / h:.2f}x | {e / h:.2f}x "
                  f"| {g / e:.2f}x |")  # fmt: skip


def _swa_checkpoint(directory: Path, num_layers: int, window: int, all_full: bool) -> str:
    kinds = ["sliding_attention", "full_attention"]
    config = dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=4096, hidden_size=512,
        intermediate_size=1024, num_hidden_layers=num_layers, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=65536, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True, use_sliding_window=not all_full, sliding_window=window,
        layer_types=["full_attention" if all_full else kinds[i % 2] for i in range(num_layers)],
        eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def prime_decode(engine: Engine, context: int) -> str:
    """Put one request at `context` tokens straight into the caches (random KV, no prefill)."""
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    seq = Sequence(f"ctx-{context}", [1] * context, params)
    engine.block_manager.grow(seq.block_table, context + 1)
    seq.num_computed_tokens = context - 1
    seq.status = SequenceStatus.RUNNING
    engine.scheduler.running.append(seq)
    engine.requests[seq.request_id] = RequestState(seq, engine.tokenizer, set(), 1 << 30)
    runner = engine.runner
    if runner.swa_layers:
        w, h, d = runner.layout.window, engine.args.num_key_value_heads, engine.args.head_dim
        runner.swa_caches[seq.request_id] = [
            WindowedKVCache.restore(
                w, torch.randn(1, h, w, d) * 0.1, torch.randn(1, h, w, d) * 0.1, context - 1
            )
            for _ in runner.swa_layers
        ]
    return seq.request_id


def bench_swa(args) -> None:
    print(f"\nSWA geometry: {args.swa_layers} layers (alternating sliding/full), window {args.window}, "
          f"Hkv 2, D 64, hidden 512, dummy weights, fp32; decode step = median of {args.swa_steps}\n")  # fmt: skip
    print("| context | SWA-layer KV bytes | pool KV bytes (full layers) | SWA layers if stored full "
          "| step ms (SWA model) | step ms (all-full model) | ratio |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    from models.default_model import default_model_path

    tmp = Path(tempfile.mkdtemp(prefix="bench_swa_"))
    tokenizer = str(default_model_path())
    engines = {}
    for all_full in (False, True):
        path = _swa_checkpoint(tmp / str(all_full), args.swa_layers, args.window, all_full)
        engines[all_full] = Engine(path, device="cpu", load_format="dummy", tokenizer=tokenizer,
                                   max_total_tokens=max(args.swa_contexts) + 64, max_num_seqs=1,
                                   enable_prefix_caching=False)  # fmt: skip
    for context in args.swa_contexts:
        times, swa_bytes = {}, 0
        for all_full, engine in engines.items():
            rid = prime_decode(engine, context)
            steps = []
            for _ in range(args.swa_steps):
                t0 = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - t0)
            times[all_full] = statistics.median(steps) * 1e3
            if not all_full:
                caches = engine.runner.swa_caches[rid]
                swa_bytes = sum(2 * c.keys.numel() * c.keys.element_size() for c in caches)
            engine.abort(rid)
        engine = engines[False]
        per_token = engine.runner.kv_bytes_per_token(engine.args, engine.dtype)
        pool_bytes = per_token * context
        swa_full = pool_bytes  # the SWA layers are half the layers: same bytes as the full ones
        print(f"| {context} | {swa_bytes:,} | {pool_bytes:,} | {swa_full:,} | {times[False]:.2f} "
              f"| {times[True]:.2f} | {times[True] / times[False]:.2f}x |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)"
    )
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | mps (part 1)")
    parser.add_argument("--compare-eager", action="store_true",
                        help="part 1: also run our engine with enforce_eager (no CUDA graphs)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per engine per batch")
    parser.add_argument(
        "--batches", default="1,8,32,64", help="comma-separated batch sizes ('' skips part 1)"
    )
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--gen-len", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine per batch (median)")
    parser.add_argument("--pool-tokens", type=int, default=16384, help="KV pool size for part 1")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch default)"
    )
    parser.add_argument("--swa-contexts", default="1024,2048,4096,8192,16384,32768",
                        help="comma-separated context lengths for part 2 ('' skips it)")  # fmt: skip
    parser.add_argument("--swa-layers", type=int, default=8, help="layers of the SWA geometry")
    parser.add_argument(
        "--window", type=int, default=128, help="sliding window of the SWA geometry"
    )
    parser.add_argument("--swa-steps", type=int, default=5, help="decode steps timed per context")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.swa_contexts = [int(c) for c in args.swa_contexts.split(",") if c]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batches:
        bench_throughput(args)
    if args.swa_contexts:
        bench_swa(args)


if __name__ == "__main__":
    main()
