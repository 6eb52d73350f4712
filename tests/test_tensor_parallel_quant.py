"""Tensor parallel with packed weights: int8 / int4 linears quantized shard by shard, against
the same quantized mode at tensor_parallel_size=1 (the oracle, itself checked against
dequantised weights by test_ops_quant_int.py). int8 row-parallel shards take the whole row's
scale (a max over the ranks), int4 shards split only at group boundaries, so every rank's codes
are the one-rank model's codes: greedy tokens are identical and logprobs differ only by the fp32
partial sums of the row-parallel matmuls."""

from __future__ import annotations

import multiprocessing

import pytest
from engine_helpers import save_engine_checkpoint
from tp_helpers import ENGINE_KWARGS, assert_same, run

from torch_runner.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread", "exact_fp32")


@pytest.mark.parametrize(
    ("model_type", "mode"), [("llama", "int8"), ("llama", "int4"), ("qwen3_moe", "int8")]
)
def test_quantized_two_ranks_match_one_rank(tmp_path, monkeypatch, model_type, mode):
    path, _ = save_engine_checkpoint(model_type, tmp_path, initializer_range=0.5)
    want = run(path, monkeypatch, quantization=mode)
    dense = run(path, monkeypatch)
    assert dense[1] != want[1], "the quantized model must differ from the dense one"
    got = run(path, monkeypatch, quantization=mode, tensor_parallel_size=2)
    assert_same(got, want)
    assert not multiprocessing.active_children()


def test_int4_shard_that_splits_a_group_is_refused_before_any_rank_starts(tmp_path):
    # down_proj: in_features 96 (3 groups of 32) at one rank, 48 per rank at two
    path, _ = save_engine_checkpoint("llama", tmp_path, intermediate_size=96)
    with pytest.raises(ValueError, match=r"down_proj shard \[64, 48\] would split an int4 group"):
        Engine(str(path), tensor_parallel_size=2, quantization="int4", **ENGINE_KWARGS)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("linear_type", ["Q4_0", "Q8_0"])
def test_gguf_two_ranks_match_one_rank(tmp_path, monkeypatch, linear_type):
    """A GGUF's Q4 codes/scales/zeros are cut like their weights (Q8_0: re-quantized per rank
    with the whole row's scales), against the same file at one rank."""
    pytest.importorskip("gguf")
    from test_models_gguf import write_tiny_gguf

    monkeypatch.setenv("TORCH_RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / f"tiny-{linear_type}.gguf", linear_type)
    want = run(path, monkeypatch)
    got = run(path, monkeypatch, tensor_parallel_size=2)
    assert_same(got, want)
    assert not multiprocessing.active_children()
