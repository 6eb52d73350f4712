"""The compiled batch-1 CPU decode step (torch_runner/runner/cpu_compiled.py), not yet an engine path.

Oracle: the flat decoder on the same pool state, each decode step of one request; the compiled
step must compile once for the whole run.
"""

import pytest
import torch
import torch._dynamo

from torch_runner import Engine, SamplingParams
from torch_runner.runner.cpu_compiled import CompiledDecoder

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def test_compiled_step_matches_the_flat_decoder_and_compiles_once(llama):
    path, _ = llama
    engine = Engine(path, device="cpu", dtype="float32", max_total_tokens=512, block_size=4,
                    weight_packing="off")  # fmt: skip
    runner = engine.runner
    compiled = CompiledDecoder(runner.model, runner.pool, runner.block_size, max_blocks=128)
    forward, steps = runner._forward_group, []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def both(group):
        want = forward(group)  # the flat decoder writes this step's K/V; compiled rewrites them
        if len(group) == 1 and group[0].num_tokens == 1:
            chunk = group[0]
            ids = torch.tensor([[chunk.seq.token_slice(chunk.start, chunk.end)[0]]])
            got = compiled(ids, torch.tensor([[chunk.start]]), chunk.seq.block_table)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            steps.append(chunk.start)
        return want

    runner._forward_group = both
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
    engine.generate([list(range(5, 15))], params)
    assert len(steps) == 11 and steps[-1] > 16  # crossed block boundaries (block_size 4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_engine_cpu_compile_on_gives_the_eager_greedy_tokens(llama):
    path, _ = llama
    kw = dict(device="cpu", dtype="float32", max_total_tokens=512, block_size=4,
              weight_packing="off")  # fmt: skip
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10)
    prompts = [[5, 6, 7], list(range(100, 111))]
    eager = Engine(path, **kw)
    want = [eager.generate([p], params)[0] for p in prompts]  # batch 1: the compiled path's
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engine = Engine(path, cpu_compile="on", **kw)
    assert engine.runner.compiled_decode is not None
    got = [engine.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_cpu_compile_rejects_unknown_values(llama):
    with pytest.raises(ValueError, match="cpu_compile='yes' is invalid; allowed values: off, on"):
        Engine(llama[0], device="cpu", cpu_compile="yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_writes_the_slot_and_matches_brute_force(dtype):
    """The compiled step's opaque KV-write + attention op over a paged pool (blocks out of order),
    against fp64 softmax attention over the same (dtype-rounded) keys with each q head on its
    kv head; bf16 runs its math in fp32, so only the final rounding to bf16 is allowed."""
    from torch_runner.runner.cpu_compiled import decode_attention

    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, block, s = 6, 2, 16, 4, 11  # 11 keys: the last of blocks [5, 2, 7]
    pool_k = torch.randn(33, hkv, d, generator=gen).to(dtype)  # 33: not a multiple of the block
    pool_v = torch.randn(33, hkv, d, generator=gen).to(dtype)
    table = torch.tensor([5, 2, 7, 0], dtype=torch.int64)
    q = torch.randn(1, hq, 1, d, generator=gen).to(dtype)
    k, v = (torch.randn(1, hkv, d, generator=gen).to(dtype) for _ in range(2))
    want_k, want_v = pool_k.clone(), pool_v.clone()
    want_k[7 * block + 2], want_v[7 * block + 2] = k[0], v[0]  # key 10: block 7, offset 2
    out = decode_attention(q, k, v, pool_k, pool_v, table, torch.tensor(s), block, 0.3)
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)
    slots = torch.cat([torch.arange(b * block, b * block + block) for b in (5, 2, 7)])[:s]
    keys, values = want_k[slots].double(), want_v[slots].double()  # [S, Hkv, D]
    group = hq // hkv
    ref = torch.empty(hq, d, dtype=torch.float64)
    for head in range(hq):
        scores = (keys[:, head // group] @ q[0, head, 0].double()) * 0.3
        ref[head] = torch.softmax(scores, dim=0) @ values[:, head // group]
    assert out.shape == (1, hq, 1, d) and out.dtype == dtype
    # fp32: the kernel's own rounding; bf16: one round-to-nearest of the result (half an ulp:
    # at most 2^-8 of the value, 8 significant bits)
    rel = 1e-6 if dtype == torch.float32 else 2**-8
    err = (out[0, :, 0].double() - ref).abs() - rel * ref.abs()
    assert float(err.max()) <= 1e-6, float(err.max())
