"""The flat CPU decode forward (torch_runner/runner/cpu_decode.py).

Oracles: the module path on the same pool state (bit for bit: the same ops on the same values)
and transformers' greedy tokens, over a staggered run of mixed lengths (batched masks, rows
joining mid-flight), with packed and dense matmul weights.
"""

import pytest
import torch
from engine_helpers import hf_greedy, run_staggered, save_engine_checkpoint

from models import native_weights
from ops.cpu_native import build
from ops.cpu_native import weights as cpu_weights
from ops.cpu_native.weights import NativePackedDenseWeight
from torch_runner import Engine, SamplingParams
from torch_runner.runner.cpu_decode import supports_fast_decode

PROMPTS = [[5, 6, 7], [100] * 11, [42], list(range(200, 219))]
MAX_TOKENS = [12, 9, 14, 10]

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(path, **kwargs):
    return Engine(path, device="cpu", dtype="float32", max_total_tokens=512, block_size=4,
                  chunked_prefill_size=8, max_num_seqs=8, **kwargs)  # fmt: skip


def _run(engine):
    """Greedy outputs of PROMPTS; the last two arrive while the first two decode."""
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in MAX_TOKENS]
    return run_staggered(engine, PROMPTS, params, arrive_at=(3, 6))


@pytest.mark.parametrize(
    "kernels,packing", [("torch", "auto"), ("torch", "off"), ("native", "auto")]
)
def test_fast_decode_is_the_module_path_bit_for_bit(llama, monkeypatch, kernels, packing):
    """Bit for bit on torch's kernels; on the native ones (ops/cpu_native: fused rms_norm,
    silu * up, fp32 attention) within fp32 rounding, the matmuls being the same kernels."""
    path, _ = llama
    monkeypatch.setenv("TORCH_RUNNER_CPU_KERNELS", kernels)
    engine = _engine(path, weight_packing=packing)
    runner = engine.runner
    flat = runner.fast_decode
    assert flat is not None
    assert (flat.native is not None) == (kernels == "native" and build.has_avx2())
    forward = runner._forward_group
    sizes = set()

    def both(group):
        if any(c.num_tokens != 1 for c in group):
            return forward(group)
        runner.fast_decode = None
        want = forward(group)  # writes this step's K/V; the fast pass rewrites the same values
        runner.fast_decode = flat
        got = forward(group)
        if flat.native is None:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        sizes.add(len(group))
        return got

    runner._forward_group = both
    _run(engine)
    assert {1, 2, 3, 4} <= sizes  # batched rows of different lengths (masks) were covered


@pytest.mark.parametrize("tiles", [True, False])
def test_fast_decode_greedy_tokens_equal_transformers(llama, monkeypatch, tiles):
    """With the decoder's matrices and the tied head tiled (ops/cpu_native/weights.prefers_tiles,
    whatever this CPU's ISA) or row-major."""
    path, hf = llama
    monkeypatch.setattr(cpu_weights, "prefers_tiles", lambda: tiles)
    engine = _engine(path)
    assert engine.runner.fast_decode is not None
    for prompt, tokens, m in zip(PROMPTS, _run(engine), MAX_TOKENS):
        assert tokens == hf_greedy(hf, prompt, m), prompt


@pytest.mark.skipif(not build.has_avx2(), reason="needs an x86-64 CPU with AVX2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_head_tiles_serve_the_embedding_lookups(llama, monkeypatch, dtype):
    """A tiled tied head replaces the embedding table: its lookups are the checkpoint's rows
    (read with transformers) and the head's tiles hold the same matrix, once."""
    monkeypatch.setenv("TORCH_RUNNER_CPU_KERNELS", "native")
    monkeypatch.setattr(cpu_weights, "prefers_tiles", lambda: True)
    engine = Engine(llama[0], device="cpu", dtype=str(dtype).split(".")[1], max_total_tokens=64)
    model = engine.runner.model
    embed, head = model.model.embed_tokens, model.lm_head.weight
    assert isinstance(embed, native_weights.TiledEmbedding) and embed.head is head
    assert engine.runner.fast_decode.embed is embed  # the dense table is not held elsewhere
    want = llama[1].get_input_embeddings().weight.detach().to(dtype)  # [V, H]
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [want.shape[0] - 1, 7, 7, 0, 9, 13]])
    assert torch.equal(embed(ids), want[ids])
    assert torch.equal(head.dequantize(), want)


@pytest.mark.parametrize("model_type", ["qwen3", "mistral", "gpt_oss", "qwen3_moe"])
def test_other_layer_kinds_keep_the_module_path(model_type, tmp_path):
    """q/k norm, sliding windows, sinks and MoE blocks are not in the flat loop."""
    path, _ = save_engine_checkpoint(model_type, tmp_path)
    runner = _engine(str(path)).runner
    assert runner.fast_decode is None
    assert not supports_fast_decode(runner.model, runner.args)


@pytest.mark.skipif(not build.has_avx2(), reason="needs an x86-64 CPU with AVX2")
@pytest.mark.parametrize("dtype,quantization,tiles", [
    ("float32", "none", True), ("bfloat16", "none", True), ("float32", "none", False),
    ("bfloat16", "none", False), ("bfloat16", "int8", True), ("bfloat16", "int8", False),
    ("float32", "int4", True)])  # fmt: skip
def test_native_decode_step_is_the_per_op_native_path_bit_for_bit(llama, monkeypatch, dtype,
                                                                  quantization, tiles):  # fmt: skip
    """decode_step (one native call a step) runs the per-op native path's kernels in its order:
    the same hidden states bit for bit, batched rows of different lengths included; dense
    weights row-major and tiled (ops/cpu_native/weights.prefers_tiles, whatever this CPU's ISA)."""
    monkeypatch.setenv("TORCH_RUNNER_CPU_KERNELS", "native")
    monkeypatch.setattr(cpu_weights, "prefers_tiles", lambda: tiles)
    engine = Engine(llama[0], device="cpu", dtype=dtype, quantization=quantization,
                    max_total_tokens=512, block_size=4, chunked_prefill_size=8,
                    max_num_seqs=8)  # fmt: skip
    runner = engine.runner
    attn = runner.model.model.layers[0].self_attn
    if quantization == "none":
        assert isinstance(attn.qkv_weight, NativePackedDenseWeight) == tiles
        assert attn.q_proj.weight.is_meta == tiles  # the rows the tiles replaced are freed
    if quantization == "int8":
        assert attn.qkv_weight.is_tiled == tiles
    flat = runner.fast_decode
    assert flat.step_args is not None
    step_args, forward, sizes = flat.step_args, runner._forward_group, set()

    def both(group):
        if any(c.num_tokens != 1 for c in group):
            return forward(group)
        flat.step_args = None
        want = forward(group)  # writes this step's K/V; decode_step rewrites the same values
        flat.step_args = step_args
        got = forward(group)
        assert torch.equal(got, want)
        sizes.add(len(group))
        return got

    runner._forward_group = both
    _run(engine)
    assert {1, 2, 3, 4} <= sizes
    assert isinstance(flat._plan[2], torch.ScriptMethod), "the steps ran a DecodePlan"


def test_native_decode_step_rejects_bad_weights(llama, monkeypatch):
    """A weight list of the wrong length or a linear of the wrong kind is a clear error."""
    if not build.has_avx2():
        pytest.skip("needs an x86-64 CPU with AVX2")
    monkeypatch.setenv("TORCH_RUNNER_CPU_KERNELS", "native")
    flat = _engine(llama[0]).runner.fast_decode
    weights, kinds, eps, hq, hkv, scale = flat.step_args
    lib, d = flat.native, flat.layers[0][6]
    h, cos = torch.zeros(1, weights[0].numel()), torch.zeros(1, d)
    pools = [torch.zeros(8, hkv, d) for _ in range(len(kinds) // 4)]
    slot, lens = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="14 weights per layer"):
        lib.decode_step(h, cos, cos, weights[:-1], kinds, eps, pools, pools, slot, slot, lens,
                        hq, hkv, scale)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"weights\[2\] \(qkv\) is None"):  # int8: no scales
        lib.decode_step(h, cos, cos, weights, [1, *kinds[1:]], eps, pools, pools, slot, slot,
                        lens, hq, hkv, scale)  # fmt: skip
    plan = torch.classes.torch_runner_native.DecodePlan  # the same checks, once
    with pytest.raises(RuntimeError, match="14 weights per layer"):
        plan(weights[:-1], kinds, eps, pools, pools, hq, hkv, scale)
    with pytest.raises(RuntimeError, match=r"weights\[2\] \(qkv\) is None"):
        plan(weights, [1, *kinds[1:]], eps, pools, pools, hq, hkv, scale)
    run = plan(weights, kinds, eps, pools, pools, hq, hkv, scale).run
    with pytest.raises(RuntimeError, match="h must be of the pools' and biases' dtype"):
        run(h.bfloat16(), cos.bfloat16(), cos.bfloat16(), slot, slot, lens)
    with pytest.raises(RuntimeError, match="kv_len out of range"):
        run(h, cos, cos, slot, slot, lens + 1)
    assert run(h, cos, cos, slot, slot, lens).shape == h.shape


def test_native_step_plan_falls_back_to_the_op_for_caches_out_of_layer_order(llama, monkeypatch):
    """A DecodePlan binds layer i to pool layer i; caches in another order (or pools) get the
    decode_step op over exactly their pools, never a plan of the wrong layers."""
    if not build.has_avx2():
        pytest.skip("needs an x86-64 CPU with AVX2")
    from types import SimpleNamespace

    monkeypatch.setenv("TORCH_RUNNER_CPU_KERNELS", "native")
    flat = _engine(llama[0]).runner.fast_decode
    weights, kinds, eps, hq, hkv, scale = flat.step_args
    layers, d = len(kinds) // 4, flat.layers[0][6]
    torch.manual_seed(0)
    k = torch.randn(layers, 8, hkv, d)
    pool = SimpleNamespace(k_layers=k.unbind(0), v_layers=torch.randn_like(k).unbind(0))
    order = [*range(1, layers), 0]  # every cache one layer on
    caches = [SimpleNamespace(pool=pool, layer=i) for i in order]
    run = flat._make_plan(caches)
    assert not isinstance(run, torch.ScriptMethod)
    h, cos = torch.randn(1, weights[0].numel()), torch.randn(1, d)
    slot, lens = torch.tensor([3]), torch.tensor([4])
    gather = torch.arange(4)
    got = run(h, cos, cos, slot, gather, lens)
    ks, vs = [t.clone() for t in pool.k_layers], [t.clone() for t in pool.v_layers]
    want = flat.native.decode_step(h, cos, cos, weights, kinds, eps, [ks[i] for i in order],
                                   [vs[i] for i in order], slot, gather, lens, hq, hkv, scale)  # fmt: skip
    assert torch.equal(got, want)
    in_order = flat._make_plan([SimpleNamespace(pool=pool, layer=i) for i in range(layers)])
    assert isinstance(in_order, torch.ScriptMethod)
