"""CUDA decode benchmark on model geometries with random bf16 weights (no checkpoint needed).

For each --geometry (llama-1b, llama-8b, gpt-oss-20b) and batch: B prompts of --prompt-len
random tokens, --gen-len greedy tokens each, CUDA graphs on (the engine's default), decode tok/s
= tokens after the first / time after the first token (median of --repeats), next to the HBM
roofline: (weight bytes read per step + KV bytes read) / --bandwidth, where an MoE step reads
the experts its B x top_k picks are expected to hit, E * (1 - (1 - k/E)^B) of E.

`steady_tok_s` counts only the window where the whole batch decodes (from the step where the last
request got its first token to the first finish): with chunked prefill the early requests of a
large batch are ahead, so `decode_tok_s` also times a shrinking batch at the end (and counts the
tokens the early requests made before the clock started).

`--sampling greedy,seeded,random` times each batch with greedy requests, with seeded top-k/top-p
requests (temperature 0.8, top_p 0.95, top_k 50, seed = request index) and with the same unseeded
on one engine. `head_in_graph` is the fraction of the timed graph decode steps whose lm_head and
sampler ran inside the graph (None: no graphs, or a checkout without the count), `graph_heads`
their kinds (path/seeding).

`--quantization int8|int4|fp8` quantizes the random bf16 weights at load (models/quantize.py);
the roofline then counts the packed bytes, and each row reports peak GPU memory (weights after
load, and the peak of the whole run). Run one mode per process for per-mode peaks.

`--new-lengths` also times eager prefill steps of prompt lengths the process has never seen
(first occurrence) against the same lengths again: with no per-shape plan builds or compiles
the ratio is ~1.

`--async-scheduling both` times overlapped scheduling on and off on one engine, runs
interleaved (on, off, on, off, ...), and reports both medians and their ratio; with
`--profile-batch B` it also profiles B-row decode steps in both modes and prints the GPU busy
time per step (torch.profiler, device events) and the idle fraction of the unprofiled step.

It imports only the public Engine API, so running it with PYTHONPATH set to another checkout
measures that checkout (before/after ratios from one call):

    PYTHONPATH=. python tools/bench_cuda_decode.py --geometry gpt-oss-20b --batches 1,8,64
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from ops.sampling.params import SamplingParams
from torch_runner import Engine

try:
    from step_trace import StepTrace  # run as tools/bench_cuda_decode.py
except ImportError:  # imported as tools.bench_cuda_decode
    from tools.step_trace import StepTrace

GEOMETRIES = {
    "llama-1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                     hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     tie_word_embeddings=True, rope_theta=500000.0),
    "llama-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                     hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=False, rope_theta=500000.0),
    "gpt-oss-20b": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"],
                        vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                        sliding_window=128, tie_word_embeddings=False, rope_theta=150000.0,
                        layer_types=["sliding_attention", "full_attention"] * 12,
                        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                          beta_slow=1.0, original_max_position_embeddings=4096,
                                          truncate=False),
                        attention_bias=True, swiglu_limit=7.0, max_position_embeddings=131072),
}  # fmt: skip
# the same geometry with its experts in MXFP4 as on disk (ops/quant: packed, Triton on CUDA)
GEOMETRIES["gpt-oss-20b-mxfp4"] = dict(GEOMETRIES["gpt-oss-20b"],
                                       quantization_config=dict(quant_method="mxfp4"))  # fmt: skip
COMMON = dict(rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              dtype="bfloat16")  # fmt: skip


def byte_tokenizer():
    """A 256-token byte-level tokenizer (ids past it decode to ''): no tokenizer files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode()[b] for b in range(256))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def write_checkpoint(name: str, directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    byte_tokenizer().save_pretrained(directory)
    config = {"max_position_embeddings": 8192, **COMMON, **GEOMETRIES[name]}
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


SAMPLING = {  # --sampling: what every request of a decode run asks for
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=0.8, top_p=0.95, top_k=50),  # + a seed per request
    "random": dict(temperature=0.8, top_p=0.95, top_k=50),  # unseeded: the generator's noise
}


def decode_run(engine: Engine, prompts, gen_len: int, sampling: str = "greedy", trace=None,
               tokens: list | None = None):  # fmt: skip
    """Decode tok/s of one batch: (tokens after each request's first / time after the first;
    steady: tokens produced while every request was decoding / that time, i.e. from the step
    where the last request got its first token to the first finish, the full batch only).
    `tokens`: filled with each request's generated ids, in prompt order."""
    rids, order = set(), []
    for i, prompt in enumerate(prompts):
        seed = {"seed": i} if sampling == "seeded" else {}
        params = SamplingParams(max_tokens=gen_len, ignore_eos=True, **SAMPLING[sampling], **seed)
        order.append(engine.add_request(None, prompt, params))
        rids.add(order[-1])
    produced = {rid: [] for rid in order}
    started, t_first, t_full, steady = set(), None, None, 0
    while engine.has_unfinished():
        if trace is not None:
            trace.begin()
        outputs = engine.step()
        if trace is not None:
            trace.end(t_full is not None and steady >= 0)
        for out in outputs:
            started.add(out.request_id)
            produced[out.request_id].extend(out.delta_token_ids)
        if t_full is not None and steady >= 0:  # the full batch's window is still open
            steady += sum(len(o.delta_token_ids) for o in outputs)
            if any(o.finished for o in outputs):
                steady_tok_s = steady / (time.perf_counter() - t_full)
                steady = -1
        if t_first is None and started >= rids:
            torch.cuda.synchronize()
            t_first = t_full = time.perf_counter()
    torch.cuda.synchronize()
    total = len(prompts) * (gen_len - 1) / (time.perf_counter() - t_first)
    if tokens is not None:
        tokens[:] = [produced[rid] for rid in order]
    return total, steady_tok_s if steady < 0 else total


def roofline(engine: Engine, batch: int, context: float, bandwidth: float) -> float:
    """Decode tok/s if every step only streamed its bytes at `bandwidth` (bytes/s)."""
    model, args = engine.runner.model, engine.args
    dense, packed_head = quantized_bytes(model)
    expert = 0
    tensors = [*model.named_parameters(), *model.named_buffers()]  # packed experts are buffers
    for name, p in tensors:
        if p.device.type == "meta" or name.endswith(("qkv_weight", "qkv_bias", "gate_up_weight",
                                                      "gate_up_bias", "inv_freq")):  # fmt: skip
            continue  # the fused matrices share the q/k/v and gate/up parameters' storage
        size = p.numel() * p.element_size()
        if ".experts." in name:
            expert += size
        elif "embed_tokens" not in name or (args.tie_word_embeddings and not packed_head):
            dense += size  # the embedding is read only for B rows unless it is the lm_head
    e = getattr(args, "num_local_experts", 0) or getattr(args, "num_experts", 0)
    if e:
        k = args.num_experts_per_tok
        expert *= 1 - (1 - k / e) ** batch
    per_layer = 2 * args.num_key_value_heads * args.head_dim * 2  # bf16 K and V
    window = args.sliding_window or 0
    kv = sum(min(context, window) if t == "sliding_attention" else context
             for t in args.layer_types) * per_layer  # fmt: skip
    step = (dense + expert + batch * kv) / bandwidth
    return batch / step


def dense_gib(model) -> float:
    """Resident dense tensors (parameters and buffers, shared storages once), GiB."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values()) / 2**30


def quantized_bytes(model) -> tuple[int, bool]:
    """Bytes of the quantized linear weights (not parameters), and whether the lm_head is one."""
    from ops.quant.int_linear import QuantizedLinearWeight

    found = {id(v): v for m in model.modules() for v in vars(m).values()
             if isinstance(v, QuantizedLinearWeight)}  # fmt: skip
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    return sum(w.nbytes() for w in found.values()), isinstance(head, QuantizedLinearWeight)


def new_length_prefills(engine: Engine, lengths, vocab: int) -> list[dict]:
    """Eager prefill step time of never-seen prompt lengths, then of the same lengths again."""
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    for length in lengths:
        times = []
        for _ in range(2):
            prompt = torch.randint(100, vocab - 1, (length,), generator=gen).tolist()
            engine.add_request(None, prompt, params)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        rows.append(dict(prompt=length, first_ms=times[0], again_ms=times[1],
                         ratio=times[0] / times[1]))  # fmt: skip
    return rows


def _device_time_us(events) -> float:
    """GPU busy time: device-side events only (an aten op also reports its kernels' time)."""
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.self_device_time_total for e in events if e.device_type == cuda)


def profile_steps(engine: Engine, batch: int, prompt_len: int, vocab: int, steps: int = 20,
                  table: bool = True, host: bool = False, kernel_trace: str = "") -> float:  # fmt: skip
    """torch.profiler table of `steps` pure decode steps at `batch` (after a warm-up); returns
    the GPU busy ms per step. `host`: then a cProfile of as many more steps (host time per
    function; time in `synchronize` is the host waiting for the GPU). `kernel_trace`: a JSON
    file of every device kernel of those steps in start order, [name, start us, duration us]
    (for per-position times offline: the GEMVs of one layer share a kernel name)."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True)
    for _ in range(batch):
        prompt = torch.randint(100, vocab - 1, (prompt_len,), generator=gen).tolist()
        engine.add_request(None, prompt, params)
    for _ in range(20):  # prefill and settle
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    if host:
        host_profile(engine, steps)
    while engine.has_unfinished():
        engine.step()
    if kernel_trace:
        write_kernel_trace(prof, kernel_trace, steps)
    events = prof.key_averages()
    gpu_us = _device_time_us(events) / steps
    cuda = torch.autograd.DeviceType.CUDA
    kernels = sum(e.count for e in events if e.device_type == cuda) / steps
    layers = engine.args.num_hidden_layers
    print(
        f"profile batch {batch}: {wall:.2f} ms/step wall (profiled), GPU busy {gpu_us / 1e3:.2f} "
        f"ms/step, {kernels:.0f} kernels/step ({kernels / layers:.1f} per layer of {layers})"
    )
    if table:
        print(events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    return gpu_us / 1e3


def write_kernel_trace(prof, path: str, steps: int) -> None:
    cuda = torch.autograd.DeviceType.CUDA
    kernels = sorted((e.time_range.start, e.time_range.end - e.time_range.start, e.name)
                     for e in prof.events() if e.device_type == cuda)  # fmt: skip
    rows = [[name, round(start, 3), round(dur, 3)] for start, dur, name in kernels]
    Path(path).write_text(json.dumps(dict(steps=steps, kernels=rows)))


def host_profile(engine: Engine, steps: int) -> None:
    """cProfile of `steps` engine steps: where the host's time per step goes."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    print(f"host profile: {(time.perf_counter() - t0) / steps * 1e3:.2f} ms/step (cProfiled)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


def profile_new_length(engine: Engine, length: int, vocab: int) -> None:
    """Profiler tables (host and device self time) of a prefill of a never-seen length, then of
    the same length again: what the first occurrence pays for."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for tag in ("first", "again"):
        engine.add_request(None, torch.randint(100, vocab - 1, (length,), generator=gen).tolist(),
                           params)  # fmt: skip
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            while engine.has_unfinished():
                engine.step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu_ms = _device_time_us(events) / 1e3
        print(f"prefill {length} {tag}: {(time.perf_counter() - t0) * 1e3:.1f} ms wall "
              f"(profiled), GPU busy {gpu_ms:.1f} ms")  # fmt: skip
        print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--geometry", required=True, choices=sorted(GEOMETRIES))
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--warmup-gen",
        type=int,
        default=None,
        help="tokens of the warm-up run (default --gen-len, so every key-bucket "
        "graph is captured before timing)",
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--eager-warmup", choices=("auto", "off"), default="auto",
                        help="EngineConfig.eager_warmup (runner/warmup.py): off to compare")  # fmt: skip
    parser.add_argument("--sampling", default="greedy", help="comma list of " + ",".join(SAMPLING))
    parser.add_argument("--async-scheduling", choices=("auto", "on", "off", "both"), default="auto",
                        help="overlapped scheduling; both: on and off interleaved, one engine")  # fmt: skip
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "fp8"])
    parser.add_argument("--fp8-weight-only-rows", type=int, default=None,
                        help="fp8: batches up to this many rows use the Triton weight-only kernel "
                        "(ops.quant.fp8.WEIGHT_ONLY_MAX_ROWS; 0: always _scaled_mm)")  # fmt: skip
    parser.add_argument("--gemv-configs", default="",
                        help="JSON tile table from tools/bench_fp8_linear.py --write-configs "
                        "(ops.quant.gemv_tiles.set_configs) for the fp8 / int8 GEMV")  # fmt: skip
    parser.add_argument("--bandwidth", type=float, default=4.25e12, help="bytes/s (H200 copy)")
    parser.add_argument("--new-lengths", default="", help="e.g. 301,517,999 ('' skips)")
    parser.add_argument("--label", default="", help="tag printed in every JSON row")
    parser.add_argument("--profile-batch", default="", help="profile decode at these B, e.g. 1,64")
    parser.add_argument("--step-trace", action="store_true",
                        help="per timed run: host / device time per step of the steady window "
                        "(tools/step_trace.py)")  # fmt: skip
    parser.add_argument("--gc-freeze", action="store_true",
                        help="freeze the start-up heap after loading, as the server does")  # fmt: skip
    parser.add_argument("--host-profile", action="store_true",
                        help="with --profile-batch: also cProfile the host per step")  # fmt: skip
    parser.add_argument("--kernel-trace", default="",
                        help="with --profile-batch: write the profiled kernels here (JSON; the "
                        "batch and mode are added to the name)")  # fmt: skip
    parser.add_argument("--profile-new-length", type=int, default=0,
                        help="profile a never-seen prefill length, then a repeat (0: off)")  # fmt: skip
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.fp8_weight_only_rows is not None:
        from ops.quant import fp8

        fp8.WEIGHT_ONLY_MAX_ROWS = args.fp8_weight_only_rows
    if args.gemv_configs:
        from ops.quant.gemv_tiles import set_configs

        table = json.loads(Path(args.gemv_configs).read_text())
        set_configs({tuple(key): tuple(cfg) for key, cfg in table})
    tmp = Path(tempfile.mkdtemp(prefix="bench_cuda_"))
    t0 = time.perf_counter()
    engine = Engine(write_checkpoint(args.geometry, tmp / args.geometry), device="cuda",
                    dtype="bfloat16", load_format="dummy",
                    max_total_tokens=max(batches) * (args.prompt_len + args.gen_len) + 4096,
                    max_num_seqs=max(batches), enable_prefix_caching=False,
                    enforce_eager=args.enforce_eager, cuda_graph_max_bs=max(batches),
                    quantization=args.quantization, eager_warmup=args.eager_warmup,
                    async_scheduling={"on": True, "off": False}.get(args.async_scheduling))  # fmt: skip
    modes = [engine.is_overlapped] if args.async_scheduling != "both" else [True, False]
    step_ms = {}  # (batch, overlapped) -> unprofiled ms per decode step
    load_s = time.perf_counter() - t0
    weights_gib = torch.cuda.memory_allocated() / 2**30  # weights (+ the KV pool)
    graphs = getattr(engine.runner, "decode_graphs", None) is not None
    trace = StepTrace(engine) if args.step_trace else None
    if args.gc_freeze:  # as the server does after its warm-up (torch_runner/gc_heap.py)
        from torch_runner.gc_heap import freeze_startup_heap

        print(json.dumps(dict(gc_frozen=freeze_startup_heap())), flush=True)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    samplings = args.sampling.split(",")
    for batch, sampling in [(b, s) for b in batches for s in samplings]:
        prompts = [torch.randint(100, vocab - 1, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(batch)]  # fmt: skip
        runs = {mode: [] for mode in modes}
        steady = {mode: [] for mode in modes}
        tokens: list = []  # the last timed run's ids: a digest to compare builds / switches
        for mode in modes:  # graph capture, allocator, autotune
            engine.is_overlapped = mode
            decode_run(engine, prompts, args.warmup_gen or args.gen_len, sampling)
        # per head, the graph decode steps run (None: eager head); absent in older checkouts
        head_steps = getattr(getattr(engine.runner, "decode_graphs", None), "head_steps", None)
        before = Counter(head_steps or {})
        for _ in range(args.repeats):
            for mode in modes:
                engine.is_overlapped = mode
                total, full = decode_run(engine, prompts, args.gen_len, sampling, trace, tokens)
                runs[mode].append(total)
                steady[mode].append(full)
                if trace is not None:  # per-step medians / p90 / max of this run's window
                    print(json.dumps(dict(step_trace=batch, async_scheduling=mode,
                                          steady_tok_s=round(full, 1), **trace.summary())), flush=True)  # fmt: skip
        # graph decode steps of the timed runs whose lm_head + sampler ran inside the graph
        heads = Counter(head_steps or {}) - before
        in_graph = sum(n for h, n in heads.items() if h is not None)
        head_in_graph = round(in_graph / sum(heads.values()), 3) if heads else None  # a fraction
        graph_heads = sorted({f"{h.kind}/{h.seeding}" for h in heads if h is not None})
        context = args.prompt_len + args.gen_len / 2
        top = roofline(engine, batch, context, args.bandwidth)
        medians = {mode: statistics.median(r) for mode, r in runs.items()}
        for mode in modes:
            tok_s = medians[mode]
            if sampling == samplings[0]:
                step_ms[batch, mode] = batch / tok_s * 1e3
            extra = {}
            if len(modes) == 2 and mode:
                extra = dict(overlap_over_sync=round(tok_s / medians[False], 3))
            print(json.dumps(dict(label=args.label, geometry=args.geometry, batch=batch, sampling=sampling,
                                  async_scheduling=mode, decode_tok_s=round(tok_s, 1),
                                  tokens_sha=hashlib.sha256(repr(tokens).encode()).hexdigest()[:12],
                                  runs=[round(r, 1) for r in runs[mode]],
                                  steady_tok_s=round(statistics.median(steady[mode]), 1),
                                  steady_runs=[round(r, 1) for r in steady[mode]],
                                  roofline_tok_s=round(top, 1), roofline_frac=round(tok_s / top, 3),
                                  graphs=graphs, head_in_graph=head_in_graph,
                                  graph_heads=graph_heads, load_s=round(load_s, 1),
                                  quantization=args.quantization,
                                  fp8_weight_only_rows=args.fp8_weight_only_rows,
                                  gemv_configs=args.gemv_configs or None,
                                  weights_gib=round(quantized_bytes(engine.runner.model)[0] / 2**30
                                                    + dense_gib(engine.runner.model), 3),
                                  allocated_after_load_gib=round(weights_gib, 2),
                                  peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                                  gpu=torch.cuda.get_device_name(), **extra)), flush=True)  # fmt: skip
    lengths = [int(x) for x in args.new_lengths.split(",") if x]
    if lengths:  # warm the allocator past every length, so only shapes are new
        new_length_prefills(engine, [max(lengths) + 64], vocab)
    for row in new_length_prefills(engine, lengths, vocab) if lengths else []:
        print(json.dumps(dict(label=args.label, geometry=args.geometry, **row)), flush=True)
    profile_batches = [int(b) for b in args.profile_batch.split(",") if b]
    for batch, mode in [(b, m) for b in profile_batches for m in modes]:
        engine.is_overlapped = mode
        trace_path = args.kernel_trace and f"{args.kernel_trace}.b{batch}.{int(mode)}.json"
        busy = profile_steps(engine, batch, args.prompt_len, vocab, table=len(modes) == 1,
                             host=args.host_profile, kernel_trace=trace_path)  # fmt: skip
        step = step_ms.get((batch, mode))
        print(json.dumps(dict(label=args.label, geometry=args.geometry, profile_batch=batch,
                              async_scheduling=mode, gpu_busy_ms=round(busy, 3),
                              step_ms=step and round(step, 3),
                              gpu_idle_frac=step and round(1 - busy / step, 3))), flush=True)  # fmt: skip
    if args.profile_new_length:
        profile_new_length(engine, args.profile_new_length, vocab)


if __name__ == "__main__":
    main()
