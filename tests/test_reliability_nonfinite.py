"""Logits that go non-finite at run time end only that request, with finish_reason "error" and
a message; its batchmates finish exactly as they would alone, and the KV pool is freed.

The fault is injected where it arises in practice, inside the forward pass: a hook on the
embedding turns one token's activations into NaN (as an fp16 overflow would), so the request
whose prompt holds that token gets NaN logits while the other rows of the same batch do not.
The oracle for the healthy rows is the same engine running them with no poisoned batchmate.
"""

from __future__ import annotations

import pytest
from engine_helpers import save_engine_checkpoint

from torch_runner import Engine, SamplingParams

POISON = 77  # a token id whose embedding output becomes NaN
HEALTHY = [[5, 6, 7, 8], list(range(20, 41))]

pytestmark = pytest.mark.usefixtures("one_thread")


def poison(engine: Engine, token_id: int = POISON):
    def hook(module, inputs, output):
        return output.masked_fill((inputs[0] == token_id)[..., None], float("nan"))

    return engine.runner.model.model.embed_tokens.register_forward_hook(hook)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path, _ = save_engine_checkpoint("llama", tmp_path_factory.mktemp("nonfinite"))
    return Engine(
        str(path), device="cpu", max_total_tokens=1024, block_size=4, enable_prefix_caching=False
    )


@pytest.mark.parametrize("logprobs", [True, False])  # False: the native greedy pick's own flag
def test_non_finite_row_ends_only_its_request(engine, logprobs):
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, logprobs=logprobs)
    alone = [o.token_ids for o in engine.generate(HEALTHY, params)]
    flagged = engine.stats()["num_non_finite_requests"]
    handle = poison(engine)
    try:
        outputs = engine.generate([HEALTHY[0], [1, 2, POISON, 3], HEALTHY[1]], params)
    finally:
        handle.remove()
    bad = outputs[1]
    assert bad.finished and bad.finish_reason == "error"
    assert "non-finite logits" in bad.error and bad.token_ids == []
    assert [outputs[0].token_ids, outputs[2].token_ids] == alone
    assert all(o.finish_reason == "length" and o.error is None for o in (outputs[0], outputs[2]))
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests
    assert engine.stats()["num_non_finite_requests"] == flagged + 1
