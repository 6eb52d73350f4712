"""Packed MXFP4 experts vs the dequantise-at-load reference: memory, MoE op time, decode tok/s.

A gpt-oss-20b geometry (24 layers, 32 experts top-4, hidden 2880, the real MXFP4 shapes) is
written by `write`: config.json (with `quantization_config: mxfp4`) and a WordLevel tokenizer,
plus, with --weights, random MXFP4 safetensors (use --layers to keep it small on a CPU box).

    python tools/bench_mxfp4.py write /tmp/oss20b --layers 2 --weights
    python tools/bench_mxfp4.py memory /tmp/oss20b          # CPU: tensor bytes and RSS, each mode
    python tools/bench_mxfp4.py op --device cuda --tokens 1,8,64     # one MoE layer, ms
    python tools/bench_mxfp4.py decode /tmp/oss20b --device cuda --batches 1,8,64  # dummy weights

`memory` and `decode` load each mode in its own subprocess (peak memory stays per mode);
`decode` runs the two modes interleaved, alternating which goes first, medians of --repeats.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

MODES = ("packed", "dequantized")
GPT_OSS_20B = dict(
    hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
    vocab_size=201088, sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
    tie_word_embeddings=False, attention_bias=True, swiglu_limit=7.0, dtype="bfloat16",
)  # fmt: skip
QUANT_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
    ],
}  # fmt: skip


def write(args) -> None:
    from tokenizers import Tokenizer, models
    from transformers import GptOssConfig, PreTrainedTokenizerFast

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    geometry = {**GPT_OSS_20B, "num_hidden_layers": args.layers}
    geometry["layer_types"] = ["sliding_attention", "full_attention"] * (args.layers // 2)
    geometry["layer_types"] += ["sliding_attention"] * (args.layers % 2)
    GptOssConfig(**geometry).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIG
    # what the real checkpoint says (llama.cpp's convert_hf_to_gguf.py needs `architectures`)
    config |= dict(architectures=["GptOssForCausalLM"], bos_token_id=199998, eos_token_id=200002,
                   pad_token_id=199999)  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"t{i}": i for i in range(geometry["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(out)
    if args.weights:
        write_weights(out, geometry)
    print(f"wrote {out} ({args.layers} layers)")


def write_weights(out: Path, geo: dict) -> None:
    """Random weights, one safetensors shard per layer (bf16 dense parts, MXFP4 experts)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    h, i, e = geo["hidden_size"], geo["intermediate_size"], geo["num_local_experts"]
    heads, kv, d = geo["num_attention_heads"], geo["num_key_value_heads"], geo["head_dim"]

    def dense(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    weight_map = {}

    def save(tensors: dict, name: str) -> None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    vocab = geo["vocab_size"]
    save({"model.embed_tokens.weight": dense(vocab, h), "lm_head.weight": dense(vocab, h),
          "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}, "embed.safetensors")  # fmt: skip
    for layer in range(geo["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t = {f"{p}input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             f"{p}post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             f"{p}self_attn.sinks": dense(heads)}  # fmt: skip
        for name, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
            t[f"{p}self_attn.{name}.weight"], t[f"{p}self_attn.{name}.bias"] = (
                dense(rows, h),
                dense(rows),
            )
        t[f"{p}self_attn.o_proj.weight"], t[f"{p}self_attn.o_proj.bias"] = (
            dense(h, heads * d),
            dense(h),
        )
        t[f"{p}mlp.router.weight"], t[f"{p}mlp.router.bias"] = dense(e, h), dense(e)
        for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            shape = (e, rows, cols // 32)
            t[f"{p}mlp.experts.{name}_blocks"] = torch.randint(
                0, 256, (*shape, 16), dtype=torch.uint8, generator=gen
            )
            t[f"{p}mlp.experts.{name}_scales"] = torch.full(shape, 120, dtype=torch.uint8)
            t[f"{p}mlp.experts.{name}_bias"] = dense(e, rows)
        save(t, f"layer{layer:02d}.safetensors")
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return -1


def memory_child(path: str, mode: str) -> dict:
    import models

    base = rss_bytes()
    loaded = models.load_model(path, device="cpu", dtype="bfloat16", moe_weights=mode)
    tensors = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())
    after_load = rss_bytes() - base
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        t0 = time.perf_counter()
        loaded.model(ids, torch.arange(4)[None], None)
        forward_s = time.perf_counter() - t0
    return {"mode": mode, "tensor_bytes": tensors, "rss_after_load": after_load,
            "rss_after_forward": rss_bytes() - base, "prefill4_s": forward_s}  # fmt: skip


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def run_child(argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    out = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory(args) -> None:
    disk = checkpoint_bytes(Path(args.dir))
    print(f"checkpoint: {disk / 2**30:.3f} GiB")
    for mode in MODES:
        r = run_child(["_memory", args.dir, mode])
        print(f"{mode:12s} tensors {r['tensor_bytes'] / 2**30:.3f} GiB ({r['tensor_bytes'] / disk:.2f}x "
              f"checkpoint)  RSS after load {r['rss_after_load'] / 2**30:.3f} GiB, after a 4-token "
              f"forward {r['rss_after_forward'] / 2**30:.3f} GiB ({r['prefill4_s']:.2f} s)")  # fmt: skip


def _time_cuda(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def random_layer(dev: torch.device):
    """One gpt-oss-20b MoE layer's random MXFP4 experts: (hidden, intermediate, experts, top-k,
    gate_up, down)."""
    from ops.quant.mxfp4 import Mxfp4Experts

    g = GPT_OSS_20B
    h, i = g["hidden_size"], g["intermediate_size"]
    e, k = g["num_local_experts"], g["num_experts_per_tok"]

    def packed(rows, cols):
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, device=dev)
        return Mxfp4Experts(
            blocks, torch.full((e, rows, cols // 32), 120, dtype=torch.uint8, device=dev)
        )

    return h, i, e, k, packed(2 * i, h), packed(h, i)


def op(args) -> None:
    """One gpt-oss-20b MoE layer at T tokens: packed Triton kernel vs dense bf16 experts."""
    from ops.moe import moe_gpt_oss
    from ops.quant.mxfp4 import dequantize

    dev = torch.device(args.device)
    h, i, e, k, gu, dn = random_layer(dev)
    bf = torch.bfloat16
    rw, rb = torch.randn(e, h, device=dev, dtype=bf) * 0.02, torch.zeros(e, device=dev, dtype=bf)
    gub, dnb = torch.zeros(e, 2 * i, device=dev, dtype=bf), torch.zeros(e, h, device=dev, dtype=bf)
    gu_dense, dn_dense = dequantize(gu, bf), dequantize(dn, bf)
    weights_read = (
        gu.blocks.numel() + gu.scales.numel() + dn.blocks.numel() + dn.scales.numel()
    ) / e
    print(
        f"one gpt-oss-20b MoE layer on {torch.cuda.get_device_name()}, bf16, median of {args.repeats}"
    )
    print(
        "| tokens | packed MXFP4 (Triton) ms | dense bf16 ms | packed CUDA graph ms | ratio | packed GB/s (routed experts) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for t in args.tokens:
        x = torch.randn(t, h, device=dev, dtype=bf)
        top = torch.topk(x @ rw.T, k).indices
        hit = int(torch.unique(top).numel())
        p_ms = _time_cuda(
            lambda x=x: moe_gpt_oss(x, rw, rb, gu, gub, dn, dnb, top_k=k), args.repeats
        )
        d_ms = _time_cuda(
            lambda x=x: moe_gpt_oss(x, rw, rb, gu_dense, gub, dn_dense, dnb, top_k=k), args.repeats
        )
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe_gpt_oss(x, rw, rb, gu, gub, dn, dnb, top_k=k)
        g_ms = _time_cuda(graph.replay, args.repeats)
        gbs = hit * weights_read / (g_ms * 1e-3) / 1e9
        print(f"| {t} | {p_ms:.3f} | {d_ms:.3f} | {g_ms:.3f} | {d_ms / p_ms:.2f}x | {gbs:.0f} |")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else rss_bytes()


GEMV_SWEEP = [((32, 32, 4, True), (16, 32, 4, True)), ((16, 8, 4, True), (16, 8, 4, True)),
              ((64, 32, 4, True), (32, 32, 4, True)), ((32, 32, 8, True), (32, 32, 8, True)),
              ((8, 128, 4, True), (8, 128, 4, True)),
              ((32, 64, 8, True), (16, 64, 8, True))]  # fmt: skip
GROUPED_SWEEP = [(128, 2, 4, 4, True), (128, 2, 4, 4, False), (64, 4, 4, 3, True),
                 (128, 4, 8, 3, True), (64, 2, 4, 4, True), (256, 2, 8, 3, True)]  # fmt: skip


def sweep(args) -> None:
    """Block configs of the packed MoE kernels (ops/quant/mxfp4_triton.py), timed in a CUDA graph
    on one gpt-oss-20b layer, each checked against the default config's output: the decode
    formulation (gate_up and down (BLOCK_N, BLOCK_G, warps, WORDS)) at the first token count,
    the grouped one ((BLOCK_N, BLOCK_G, warps, stages, WORDS)) above GEMV_MAX_TOKENS, and both
    formulations' defaults at the counts in between (where they cross over)."""
    from ops.quant.mxfp4_triton import GEMV_MAX_TOKENS, moe_experts_mxfp4

    dev = torch.device(args.device)
    h, i, e, k, gu, dn = random_layer(dev)
    gub = torch.randn(e, 2 * i, device=dev, dtype=torch.bfloat16) * 0.1
    dnb = torch.randn(e, h, device=dev, dtype=torch.bfloat16) * 0.1
    per_expert = (gu.blocks.numel() + gu.scales.numel() + dn.blocks.numel() + dn.scales.numel()) / e
    for t in args.tokens:
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        top = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
        scores = torch.softmax(torch.randn(t, k, device=dev), -1).to(torch.bfloat16)
        hit = int(torch.unique(top).numel())
        want = moe_experts_mxfp4(x, top, scores, gu, gub, dn, dnb, 7.0, 1.702)
        cases = [("grouped", c) for c in GROUPED_SWEEP]
        if t == args.tokens[0] and t <= GEMV_MAX_TOKENS:
            cases = [("gemv", c) for c in GEMV_SWEEP] + [("grouped", None)]
        elif t <= 8:
            cases = [("gemv", None), ("grouped", None)]
        for form, cfg in cases:
            run = functools.partial(moe_experts_mxfp4, x, top, scores, gu, gub, dn, dnb, 7.0,
                                    1.702, formulation=form, config=cfg)  # fmt: skip
            err = ((run().float() - want.float()).abs().max() / want.float().abs().max()).item()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            ms = _time_cuda(graph.replay, args.repeats)
            gbs = hit * per_expert / (ms * 1e-3) / 1e9
            print(f"tokens {t}: {form} {cfg} {ms * 1e3:.1f} us, {gbs:.0f} GB/s of routed experts, "
                  f"max err / max {err:.1e}", flush=True)  # fmt: skip
    op(args)


def decode_child(
    path: str,
    mode: str,
    batches: list[int],
    prompt_len: int,
    gen_len: int,
    device: str,
    eager: bool,
) -> list[dict]:
    """One engine (one mode) decodes every batch size; CUDA graphs unless `eager`."""
    from ops.sampling.params import SamplingParams
    from torch_runner import Engine

    top = max(batches)
    engine = Engine(path, device=device, dtype="bfloat16", load_format="dummy", moe_weights=mode,
                    max_total_tokens=max(4096, top * (prompt_len + gen_len) * 2),
                    max_num_seqs=max(top, 1), enforce_eager=eager,
                    cuda_graph_max_bs=max(top, 1))  # fmt: skip
    graphs = getattr(engine.runner, "decode_graphs", None) is not None
    weights_peak = _peak(device)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    rows = []
    for batch in batches:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        results = []
        for _ in range(2):  # the first round captures graphs, warms kernels and the allocator
            rids = {engine.add_request(None, torch.randint(10, 200000, (prompt_len,), generator=gen).tolist(), params)
                    for _ in range(batch)}  # fmt: skip
            started, t_first = set(), None
            while engine.has_unfinished():
                started.update(out.request_id for out in engine.step())
                if t_first is None and started >= rids:
                    _sync(device)
                    t_first = time.perf_counter()
            _sync(device)
            results.append(batch * (gen_len - 1) / (time.perf_counter() - t_first))
        rows.append({"mode": mode, "batch": batch, "decode_tok_s": results[-1], "graphs": graphs,
                     "weights_peak_gib": weights_peak / 2**30,
                     "peak_gib": _peak(device) / 2**30})  # fmt: skip
    return rows


def decode(args) -> None:
    kind = "eager" if args.enforce_eager else "CUDA graphs"
    print(
        f"gpt-oss-20b geometry, dummy weights, bf16, {kind}, prompt {args.prompt_len} + "
        f"{args.gen_len}; one process per mode and round, modes alternating which goes first"
    )
    runs = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            argv = ["_decode", args.dir, mode, ",".join(map(str, args.batches)),
                    str(args.prompt_len), str(args.gen_len), args.device,
                    "1" if args.enforce_eager else "0"]  # fmt: skip
            runs[mode].append(run_child(argv))
    print("| batch | mode | decode tok/s (median) | graphs | weights GiB | peak GiB |")
    print("|---:|---|---:|---|---:|---:|")
    for i, batch in enumerate(args.batches):
        for mode in MODES:
            tok_s = statistics.median(rnd[i]["decode_tok_s"] for rnd in runs[mode])
            last = runs[mode][-1][i]
            print(
                f"| {batch} | {mode} | {tok_s:.1f} | {last['graphs']} | "
                f"{last['weights_peak_gib']:.2f} | {last['peak_gib']:.2f} |",
                flush=True,
            )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_memory":
        print(json.dumps(memory_child(sys.argv[2], sys.argv[3])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_decode":
        a = sys.argv[2:]
        batches = [int(b) for b in a[2].split(",")]
        rows = decode_child(a[0], a[1], batches, int(a[3]), int(a[4]), a[5], a[6] == "1")
        print(json.dumps(rows))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir")
    w.add_argument("--layers", type=int, default=24)
    w.add_argument("--weights", action="store_true")
    m = sub.add_parser("memory")
    m.add_argument("dir")
    o = sub.add_parser("op")
    o.add_argument("--device", default="cuda")
    o.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    o.add_argument("--repeats", type=int, default=20)
    o.add_argument("--sweep", action="store_true", help="time kernel configs instead")
    d = sub.add_parser("decode")
    d.add_argument("dir")
    d.add_argument("--device", default="cuda")
    d.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    d.add_argument("--prompt-len", type=int, default=32)
    d.add_argument("--gen-len", type=int, default=32)
    d.add_argument("--repeats", type=int, default=1)
    d.add_argument("--enforce-eager", action="store_true", help="eager decode (default: graphs)")
    args = parser.parse_args()
    if args.cmd == "op" and args.sweep:
        return sweep(args)
    {"write": write, "memory": memory, "op": op, "decode": decode}[args.cmd](args)


if __name__ == "__main__":
    main()
