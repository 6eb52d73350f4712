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


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("linear_type", ["Q4_0", "Q8_0"])
def test_gguf_rank_decodes_only_its_rows_and_blocks(tmp_path, monkeypatch, linear_type, rank):
    """Each rank cuts the raw GGUF data before decoding (rows; columns at 32-value blocks): every
    dense tensor and Q4 codes/scales/zeros equal the whole file decoded, then cut (the oracle),
    and the Q4 decoder only ever sees this rank's shape."""
    pytest.importorskip("gguf")
    import torch
    from test_models_gguf import write_tiny_gguf

    from models import gguf_loader, loader
    from models.registry import get_family
    from torch_runner.distributed.experts import narrow
    from torch_runner.distributed.shard import ShardPlan

    monkeypatch.setenv("TORCH_RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / f"tiny-{linear_type}.gguf", linear_type)
    hf_config = loader._hf_config(gguf_loader.sidecar_folder(path))
    family = get_family(hf_config.model_type)
    with torch.device("meta"):
        model = family.Model(family.ModelArgs.from_hf_config(hf_config))
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    whole, whole_q4, _, _ = gguf_loader.read_weights(
        path, expected, hf_config, torch.float32, "auto"
    )
    plan = ShardPlan(rank, 2, group=None)
    with torch.device("meta"):
        plan.prepare(model)
    slices = {name: cut.spec for name, cut in plan.slices.items() if hasattr(cut, "spec")}
    decoded = []
    int4_blocks = gguf_loader.int4_blocks
    monkeypatch.setattr(gguf_loader, "int4_blocks",
                        lambda data, kind, shape: decoded.append(shape) or int4_blocks(data, kind, shape))  # fmt: skip
    part, part_q4, _, _ = gguf_loader.read_weights(path, expected, hf_config, torch.float32, "auto",
                                                   slices)  # fmt: skip
    assert part.keys() == whole.keys() and part_q4.keys() == whole_q4.keys()
    for name, tensor in whole.items():
        want = plan.slices[name](tensor) if name in slices else tensor
        assert torch.equal(part[name], want), name
    for name, (codes, scales, zeros) in whole_q4.items():
        dim, start, length, pad = slices[name]
        group = narrow(dim, start // 32, length // 32) if dim else narrow(dim, start, length, pad)
        assert torch.equal(part_q4[name][0], narrow(dim, start, length, pad)(codes)), name
        assert torch.equal(part_q4[name][1], group(scales)) and torch.equal(
            part_q4[name][2], group(zeros)
        )
    if linear_type == "Q4_0":  # decoded in `expected` order, each at this rank's shape
        assert whole_q4 and decoded == [tuple(codes.shape) for codes, _, _ in part_q4.values()]
