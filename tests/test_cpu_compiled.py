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
