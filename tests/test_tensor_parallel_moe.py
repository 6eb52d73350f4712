"""MoE under tensor parallel on 2 gloo ranks against the same engine at tensor_parallel_size=1:
expert parallel (whole experts per rank, dense qwen3_moe and gpt-oss, packed MXFP4 gpt-oss) and
packed MXFP4 experts split within each expert at 32-value block boundaries. The one-rank engine
is the oracle (pinned to transformers by test_models_mxfp4.py and the parity tests). Greedy
tokens are identical; logprobs agree to the fp32 tolerance of summing the ranks' partial outputs."""

from __future__ import annotations

import multiprocessing

import pytest
import tp_helpers
from engine_helpers import byte_tokenizer, save_engine_checkpoint
from test_models_mxfp4 import write_mxfp4_gpt_oss
from tp_helpers import ENGINE_KWARGS, run

from torch_runner.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_same(got, want):
    tp_helpers.assert_same(got, want)
    assert 0.5 <= got[2] / want[2] < 0.56, "rank 0 holds about half the weights"


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_expert_parallel_matches_one_rank(tmp_path, monkeypatch, model_type):
    path, _ = save_engine_checkpoint(model_type, tmp_path, initializer_range=0.5)
    want = run(path, monkeypatch)
    got = run(path, monkeypatch, tensor_parallel_size=2, enable_expert_parallel=True)
    assert_same(got, want)
    assert not multiprocessing.active_children()


@pytest.fixture
def mxfp4_checkpoint(tmp_path):
    path = write_mxfp4_gpt_oss(tmp_path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["within", "expert_parallel"])
def test_packed_mxfp4_experts_shard_packed(mxfp4_checkpoint, monkeypatch, expert_parallel):
    want = run(mxfp4_checkpoint, monkeypatch, moe_weights="packed")
    got = run(mxfp4_checkpoint, monkeypatch, moe_weights="packed", tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel)  # fmt: skip
    assert_same(got, want)


@pytest.mark.parametrize(
    ("model_type", "overrides", "kwargs", "message"),
    [
        ("qwen3_moe", dict(num_experts=3), dict(enable_expert_parallel=True),
         r"must divide the number of experts \(3\)"),
        ("gpt_oss", dict(intermediate_size=32), dict(moe_weights="packed"),
         r"intermediate_size \(32 / 2\) must be a multiple of the 32-value"),
    ],
)  # fmt: skip
def test_moe_shards_that_do_not_split_are_refused(tmp_path, model_type, overrides, kwargs, message):
    import json

    path, _ = save_engine_checkpoint(model_type, tmp_path, **overrides)
    if model_type == "gpt_oss":  # the launch check reads only config.json
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4"}
        (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        Engine(str(path), tensor_parallel_size=2, **ENGINE_KWARGS, **kwargs)
    assert not multiprocessing.active_children()


def test_enable_expert_parallel_flag_reaches_the_engine_config():
    from torch_runner.serve.cli import build_parser, engine_config

    parser = build_parser()
    assert engine_config(parser.parse_args(["-tp", "2"])).enable_expert_parallel is False
    args = parser.parse_args(["-tp", "2", "--enable-expert-parallel"])
    assert engine_config(args).enable_expert_parallel is True
