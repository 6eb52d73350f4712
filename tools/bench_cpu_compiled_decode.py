"""Would an inductor-compiled batch-1 CPU decode step beat the flat decoder? A measurement, not a path.

The flat decoder (torch_runner/runner/cpu_decode.py) runs ~45 small aten ops per layer around
the weight kernels (rms_norm's composite, rope's flip/mul/add, views, the KV writes, the residual
adds); on the 2-core box they cost about as much as the int4 / int8 kernels themselves
(performance-log.md, 2026-12-02 02:00). This tool compiles the same batch-1 step with
`torch.compile` (inductor's C++ CPU backend, freezing: weights become constants, packed for
oneDNN / MKL by inductor itself) so the small ops fuse into a few C++ loops; the KV write and the
attention stay one opaque op (`bench_cpu_compiled::decode_attention`, a torch.library custom op
over a contiguous per-layer pool) so the graph has static shapes and compiles once.

For each mode it checks that the compiled step's greedy tokens equal the uncompiled step's (same
weights), then times, interleaved with the order alternating: the engine's own decode (flat
decoder, default packing), the uncompiled step and the compiled step, tok/s medians over --rounds.

    PYTHONPATH=. .venv/bin/python tools/bench_cpu_compiled_decode.py --modes bfloat16:int4,bfloat16:none
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import ops
from models.layers import rope_tables
from ops.attention import CPU_FLASH
from ops.norm import rms_norm_unchecked
from ops.rope import rotate

# defined with the low-level torch.library API, not `torch.library.custom_op`: the latter's Python
# wrapper (autograd and fake-mode plumbing) cost ~120 us per call here, 3.5 ms per step over 30 layers
_LIB = torch.library.Library("bench_cpu_compiled", "DEF")
_LIB.define(
    "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) pool_k, Tensor(b!) pool_v, "
    "Tensor slot, Tensor length, float scale) -> Tensor"
)


def decode_attention_cpu(q, k, v, pool_k, pool_v, slot, length, scale):
    """Store k, v [1, Hkv, D] at `slot` [1] of the layer's pool [S_max, Hkv, D], attend q
    [1, Hq, 1, D] over its first `length` (0-dim) keys -> [1, Hq, 1, D]."""
    pool_k.index_copy_(0, slot, k)
    pool_v.index_copy_(0, slot, v)
    s = int(length)  # a CPU tensor: no device sync; inside the opaque op, so no recompile
    h, d = k.shape[1:]
    keys = pool_k[:s].view(1, s, h, d).transpose(1, 2)  # [1, Hkv, S, D]
    values = pool_v[:s].view(1, s, h, d).transpose(1, 2)
    return CPU_FLASH(q, keys, values, 0.0, False, attn_mask=None, scale=scale)[0]


_LIB.impl("decode_attention", decode_attention_cpu, "CPU")
_LIB.impl("decode_attention", lambda q, *rest: torch.empty_like(q), "Meta")
decode_attention = torch.ops.bench_cpu_compiled.decode_attention


class DecodeStep(torch.nn.Module):
    """One token of a Llama-style model (fused q/k/v and gate/up), batch 1 -> logits [1, V]."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, positions, slot, length, pools_k: list, pools_v: list):
        decoder = self.model.model
        h = decoder.embed_tokens(ids)  # [1, H]
        rot = decoder.rotary
        cos, sin = rope_tables(positions, rot.inv_freq, rot.attention_scaling, h.dtype)
        for layer, pool_k, pool_v in zip(decoder.layers, pools_k, pools_v):
            attn, mlp = layer.self_attn, layer.mlp
            hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            x = rms_norm_unchecked(h, ln1.weight, ln1.eps)
            qkv = ops.linear(x, attn.qkv_weight).view(1, 1, hq + 2 * hkv, d)
            qk = rotate(qkv[:, :, : hq + hkv], cos, sin)  # [1, 1, Hq + Hkv, D]
            q = qk[:, :, :hq].transpose(1, 2)  # [1, Hq, 1, D]
            out = decode_attention(q, qk[:, 0, hq:], qkv[:, 0, hq + hkv :], pool_k, pool_v, slot,
                                   length, attn.scale)  # fmt: skip
            h = ops.linear(out.transpose(1, 2).reshape(1, hq * d), attn.o_proj.weight) + h
            x = rms_norm_unchecked(h, ln2.weight, ln2.eps)
            gate, up = ops.linear(x, mlp.gate_up_weight).chunk(2, dim=-1)
            h = ops.linear(F.silu(gate) * up, mlp.down_proj.weight) + h
        return self.model.compute_logits(
            rms_norm_unchecked(h, decoder.norm.weight, decoder.norm.eps)
        )


def step_runner(step, model, dtype, max_len: int = 1024):
    """A greedy loop over `step` with its own contiguous KV pools; returns run(n, start)."""
    layers = model.model.layers
    a0 = layers[0].self_attn
    pools_k = [torch.zeros(max_len, a0.num_kv_heads, a0.head_dim, dtype=dtype) for _ in layers]
    pools_v = [torch.zeros_like(p) for p in pools_k]

    @torch.no_grad()
    def run(n: int, start: int = 0) -> list[int]:
        token, tokens = 100, []
        for pos in range(start, start + n):
            logits = step(torch.tensor([token]), torch.tensor([[pos]]), torch.tensor([pos]),
                          torch.tensor(pos + 1), pools_k, pools_v)  # fmt: skip
            token = int(logits.argmax())  # the greedy token, read on the host as the engine does
            tokens.append(token)
        return tokens

    return run


def engine_tok_s(engine, n: int) -> float:
    from ops.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    engine.add_request(None, list(range(100, 132)), params)
    engine.step()
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - t0)


def bench_mode(dtype: str, quant: str, rounds: int, gen_len: int) -> None:
    import torch._inductor.config as inductor_config

    from torch_runner import Engine

    kw = dict(device="cpu", dtype=dtype, quantization=quant, max_total_tokens=1024)
    engine = Engine(**kw)  # the flat decoder, as served
    model = Engine(**kw, weight_packing="off").runner.model  # dense weights: inductor packs them
    for layer in model.model.layers:
        for part in (layer.self_attn, layer.mlp):
            if getattr(part, "qkv_weight", getattr(part, "gate_up_weight", None)) is None:
                part.fuse()
    act = torch.bfloat16 if dtype == "auto" else getattr(torch, dtype)
    step = DecodeStep(model).eval()
    inductor_config.freezing = True
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    eager_run, compiled_run = step_runner(step, model, act), step_runner(compiled, model, act)
    t0 = time.perf_counter()
    compiled_run(2)
    compile_s = time.perf_counter() - t0
    # shapes and dtypes never change between calls here: the guards can be skipped
    torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    same = eager_run(48) == compiled_run(48)
    engine_tok_s(engine, 8)
    timings: dict[str, list[float]] = {"engine (flat decoder)": [], "step": [], "compiled": []}

    def timed_run(run) -> float:
        t0 = time.perf_counter()
        run(gen_len, 100)
        return gen_len / (time.perf_counter() - t0)

    for r in range(rounds):
        names = list(timings) if r % 2 == 0 else list(timings)[::-1]
        for name in names:
            if name == "step":
                timings[name].append(timed_run(eager_run))
            elif name == "compiled":
                timings[name].append(timed_run(compiled_run))
            else:
                timings[name].append(engine_tok_s(engine, gen_len))
    torch.compiler.set_stance("default")
    med = {k: statistics.median(v) for k, v in timings.items()}
    flat = med["engine (flat decoder)"]
    print(f"| {dtype} / {quant} | {compile_s:.0f} | {same} | "
          + " | ".join(f"{v:.1f}" for v in med.values())
          + f" | {med['compiled'] / flat:.2f} |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default="bfloat16:int4,bfloat16:none", help="dtype:quant list")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, batch 1, {args.gen_len} tokens, "
          f"medians of {args.rounds} interleaved rounds")  # fmt: skip
    print("| mode | compile s | compiled tokens == step's | engine (flat) tok/s | step tok/s | "
          "compiled tok/s | compiled / flat |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        dtype, quant = mode.split(":")
        bench_mode(dtype, quant, args.rounds, args.gen_len)


if __name__ == "__main__":
    main()
