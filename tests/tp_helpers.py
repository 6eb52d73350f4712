"""Shared set-up of the 2-gloo-rank engine tests (test_tensor_parallel_quant.py,
test_tensor_parallel_moe.py): one workload, run at tp 1 (the oracle) and tp 2, compared."""

from __future__ import annotations

import pytest

from ops.sampling.params import SamplingParams
from torch_runner.engine import Engine

LOGPROB_ATOL = 1e-4  # the fp32 tolerance of summing the ranks' partial outputs
ENGINE_KWARGS = dict(device="cpu", dtype="float32", max_total_tokens=128, chunked_prefill_size=16,
                     swa_kv="paged")  # fmt: skip
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True)
PROMPTS = [[7, 3, 9, 4, 1, 8, 5, 6] * 3, [20, 21, 22], [40] * 17]


def run(path, monkeypatch, **kwargs):
    """(token ids, logprobs, rank 0's state-dict element count) of PROMPTS on a fresh engine."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    engine = Engine(str(path), **{**ENGINE_KWARGS, **kwargs})
    try:
        outs = engine.generate(PROMPTS, PARAMS)
        weights = sum(t.numel() for t in engine.runner.model.state_dict().values())
    finally:
        engine.close()
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs], weights


def assert_same(got, want):
    """Identical greedy tokens, logprobs within LOGPROB_ATOL."""
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        assert a == pytest.approx(b, abs=LOGPROB_ATOL)
