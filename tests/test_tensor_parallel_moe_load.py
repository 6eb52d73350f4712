"""MoE experts that the family's sanitize builds from several checkpoint tensors (Qwen3-MoE's
per-expert Hub tensors, stacked; gpt-oss MXFP4 experts with moe_weights="dequantized") are read
with pread straight into their stacked buffer, at one rank and as a tensor-parallel rank's part
(within experts, whole experts). Oracle: the transformers model's own stacked experts (Qwen3-MoE)
and dequantize_mxfp4 of the whole checkpoint tensors (gpt-oss), sliced by index here; and the
2-gloo-rank engine against the one-rank engine (greedy tokens identical, logprobs to fp32)."""

from __future__ import annotations

import pytest
import torch
import tp_helpers
from engine_helpers import byte_tokenizer, save_engine_checkpoint
from safetensors.torch import load_file, save_file
from test_models_mxfp4 import write_mxfp4_gpt_oss
from tp_helpers import run

import models
from models.mxfp4 import dequantize_mxfp4
from torch_runner.distributed.shard import ShardPlan

pytestmark = pytest.mark.usefixtures("one_thread")


def write_hub_qwen3_moe(directory):
    """A tiny Qwen3-MoE folder laid out like the Hub checkpoints (one tensor per expert and
    projection); returns (path, the transformers model's stacked state dict)."""
    path, reference = save_engine_checkpoint("qwen3_moe", directory, initializer_range=0.5)
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    tensors = {}
    for file in path.glob("*.safetensors"):
        tensors |= load_file(file)
        file.unlink()
    hub = {}
    for name, value in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":  # [E, 2I, H]: gate rows, then up
            inter = value.shape[1] // 2
            for e in range(value.shape[0]):
                hub[f"{prefix}.{e}.gate_proj.weight"] = value[e, :inter].clone()
                hub[f"{prefix}.{e}.up_proj.weight"] = value[e, inter:].clone()
        elif leaf == "down_proj" and ".experts" in prefix:  # [E, H, I]
            for e in range(value.shape[0]):
                hub[f"{prefix}.{e}.down_proj.weight"] = value[e].clone()
        else:
            hub[name] = value
    save_file(hub, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, state


def rank_experts(path, rank=None, expert_parallel=False, **kwargs):
    """{name: tensor} of the expert tensors as loaded at one rank (rank None) or as `rank` of 2."""
    shard = None
    if rank is not None:
        shard = ShardPlan(rank=rank, size=2, group=None, expert_parallel=expert_parallel)
    loaded = models.load_model(path, device="cpu", dtype="float32", shard=shard, **kwargs)
    return {k: v for k, v in loaded.model.state_dict().items() if ".experts." in k}


QWEN3_CASES = [(None, False), (0, False), (1, False), (0, True), (1, True)]
IDS = ["tp1", "within-rank0", "within-rank1", "ep-rank0", "ep-rank1"]


@pytest.mark.parametrize(("rank", "expert_parallel"), QWEN3_CASES, ids=IDS)
def test_hub_qwen3_moe_experts_load_as_the_checkpoint(tmp_path, monkeypatch, rank, expert_parallel):
    path, state = write_hub_qwen3_moe(tmp_path)

    def no_stack(*args, **kwargs):
        raise AssertionError("the experts were stacked from in-memory copies, not read in place")

    monkeypatch.setattr(torch, "stack", no_stack)  # each expert is pread into its rows instead
    loaded = rank_experts(path, rank, expert_parallel)
    monkeypatch.undo()
    stacked = [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert sorted(loaded) == sorted(stacked)
    for name in stacked:
        want = state[name].float()  # [E, 2I, H] / [E, H, I]
        if rank is not None and expert_parallel:
            half = want.shape[0] // 2
            want = want[rank * half : (rank + 1) * half]
        elif rank is not None and name.endswith("gate_up_proj"):
            inter, size = want.shape[1] // 2, want.shape[1] // 4
            rows = [*range(rank * size, (rank + 1) * size)]
            want = want[:, rows + [inter + r for r in rows]]
        elif rank is not None:
            size = want.shape[2] // 2
            want = want[:, :, rank * size : (rank + 1) * size]
        assert torch.equal(loaded[name], want), name


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["within", "expert_parallel"])
def test_hub_qwen3_moe_tp2_matches_one_rank(tmp_path, monkeypatch, expert_parallel):
    path, _ = write_hub_qwen3_moe(tmp_path)
    want = run(path, monkeypatch)
    got = run(path, monkeypatch, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    tp_helpers.assert_same(got, want)


def no_whole_dequantization(monkeypatch):
    """Fail a load that dequantizes more than one expert at a time (the whole-tensor path)."""
    import models.mxfp4 as mxfp4

    real = mxfp4.dequantize_mxfp4

    def one_expert(blocks, scales, dtype):
        assert blocks.shape[0] == 1, "a whole expert tensor was dequantized at once"
        return real(blocks, scales, dtype)

    monkeypatch.setattr(mxfp4, "dequantize_mxfp4", one_expert)


GPT_OSS_CASES = [(None, False, 64), (0, False, 64), (1, False, 64), (0, True, 64), (1, True, 64),
                 (1, False, 32)]  # fmt: skip
GPT_OSS_IDS = [*IDS, "within-rank1-unaligned"]


@pytest.mark.parametrize(("rank", "expert_parallel", "inter"), GPT_OSS_CASES, ids=GPT_OSS_IDS)
def test_dequantized_mxfp4_experts_load_as_the_checkpoint(
    tmp_path, monkeypatch, rank, expert_parallel, inter
):
    path = write_mxfp4_gpt_oss(tmp_path, intermediate_size=inter)
    file = load_file(path / "model.safetensors")
    no_whole_dequantization(monkeypatch)  # inter 32: a rank's down is cut after dequantizing
    loaded = rank_experts(path, rank, expert_parallel, moe_weights="dequantized")
    monkeypatch.undo()
    for name in [k.removesuffix("_blocks") for k in file if k.endswith("_blocks")]:
        want = dequantize_mxfp4(file[f"{name}_blocks"], file[f"{name}_scales"], torch.bfloat16)
        want = want.float()  # gate_up [E, H, 2I] (gate, up interleaved), down [E, I, H]
        if rank is not None and expert_parallel:
            half = want.shape[0] // 2
            want = want[rank * half : (rank + 1) * half]
        elif rank is not None and name.endswith("gate_up_proj"):
            size = want.shape[2] // 2
            want = want[:, :, rank * size : (rank + 1) * size]
        elif rank is not None:
            size = want.shape[1] // 2
            want = want[:, rank * size : (rank + 1) * size]
        assert torch.equal(loaded[name], want), name


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["within", "expert_parallel"])
def test_dequantized_mxfp4_tp2_matches_one_rank(tmp_path, monkeypatch, expert_parallel):
    path = write_mxfp4_gpt_oss(tmp_path)
    byte_tokenizer().save_pretrained(path)
    want = run(path, monkeypatch, moe_weights="dequantized")
    got = run(path, monkeypatch, moe_weights="dequantized", tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel)  # fmt: skip
    tp_helpers.assert_same(got, want)
