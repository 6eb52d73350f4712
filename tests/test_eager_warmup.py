"""runner/warmup.py: the start-up forwards cover every eager matmul row count a step can
produce (observed through ops.linear's own eager path), and leave generation unchanged."""

import pytest
import torch
from engine_helpers import save_engine_checkpoint

from ops.linear import _linear_eager_cuda
from torch_runner import Engine, SamplingParams
from torch_runner.runner.warmup import prefill_lengths, row_buckets, warm_up_eager_shapes

pytestmark = pytest.mark.usefixtures("one_thread")


def _eager_rows(rows: int, monkeypatch) -> int:
    """The M ops.linear's eager CUDA path hands cuBLAS for `rows` input rows (run on CPU)."""
    seen = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append(a.shape[0]) or real_mm(a, b))
    _linear_eager_cuda(torch.ones(rows, 8), torch.ones(4, 8), None)
    monkeypatch.undo()
    return seen[0]


@pytest.mark.parametrize("limit", [1, 16, 17, 64, 65, 512, 700])
def test_warmup_runs_every_row_count_the_eager_path_produces(limit, monkeypatch):
    needed = {_eager_rows(n, monkeypatch) for n in range(1, limit + 1)}
    assert needed <= {_eager_rows(m, monkeypatch) for m in row_buckets(limit)}
    prefills = {_eager_rows(n, monkeypatch) for n in prefill_lengths(limit)}
    assert {m for m in needed if m > 1} == prefills  # 1 row: decode, in the graphs
    assert all(n <= limit for n in prefill_lengths(limit))


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss"])
def test_warmup_forwards_leave_outputs_unchanged(model_type, tmp_path):
    path, _ = save_engine_checkpoint(model_type, tmp_path, initializer_range=0.5)
    prompts = [list(range(20, 51)), [5, 6, 7], [100] * 11]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for warm in (False, True):
        engine = Engine(str(path), device="cpu", max_total_tokens=256, block_size=4,
                        chunked_prefill_size=16)  # fmt: skip
        if warm:  # NaN keys in the blocks it used would reach any request that read them
            assert warm_up_eager_shapes(engine.runner, 80, 5) == len(prefill_lengths(80)) + 5
            assert not engine.runner.swa_caches
        outs.append([o.token_ids for o in engine.generate(prompts, params)])
    assert outs[0] == outs[1]
