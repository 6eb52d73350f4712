"""Tensor parallel over fp8 checkpoints (CPU reference path, 2 gloo ranks): each rank keeps its
slice of every e4m3 weight and of its scales (per tensor: whole; per channel: the weight's rows;
per block: whole blocks), against the same weights dequantised to fp32 at tensor_parallel_size=1
(the oracle fp8_checkpoints.py writes beside the fp8 folder). Greedy tokens are identical and
logprobs differ only by the fp32 partial sums of the row-parallel matmuls."""

from __future__ import annotations

import multiprocessing

import pytest
from fp8_checkpoints import write_fp8_checkpoint
from tp_helpers import ENGINE_KWARGS, assert_same, run

from torch_runner.engine import Engine

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]  # fmt: skip
SPREAD = 0.5  # weights wide enough that fp8 rounding changes the model's tokens


@pytest.mark.parametrize(
    ("layout", "overrides"),
    [("tensor", {}), ("channel", {}), ("block", {"head_dim": 32})],  # blocks 32x32: whole per rank
)
def test_fp8_two_ranks_match_the_dequantised_model_at_one_rank(
    tmp_path, monkeypatch, layout, overrides
):
    fp8_dir, dense_dir = write_fp8_checkpoint(tmp_path, layout, initializer_range=SPREAD,
                                              **overrides)  # fmt: skip
    want = run(dense_dir, monkeypatch)
    got = run(fp8_dir, monkeypatch, tensor_parallel_size=2)
    assert_same(got, want)
    assert got[2] < want[2] * 0.7, "rank 0 must hold its shard, not the whole model"
    assert not multiprocessing.active_children()


def test_fp8_shard_that_splits_a_scale_block_is_refused_before_any_rank_starts(tmp_path):
    # head_dim 16, 2 KV heads: each rank's k_proj / v_proj has 16 rows, half a 32-row block
    fp8_dir, _ = write_fp8_checkpoint(tmp_path, "block")
    with pytest.raises(ValueError, match=r"k_proj/v_proj rows \(16\) must be a multiple of 32"):
        Engine(str(fp8_dir), tensor_parallel_size=2, **ENGINE_KWARGS)
    assert not multiprocessing.active_children()
