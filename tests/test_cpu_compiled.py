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
