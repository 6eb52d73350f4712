"""The tensor-parallel group of one rank, in this process: the backend a device picks (gloo on
CPU, NCCL on CUDA, where a one-GPU machine can run nothing larger) initialises, a shard plan of
one rank loads, and a step through its all-reduces and logits gather gives the plain runner's
logits (the oracle: the same checkpoint without any plan)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import save_engine_checkpoint

from models import load_model
from torch_runner.config import EngineConfig
from torch_runner.distributed.group import TPGroup, free_port
from torch_runner.distributed.shard import ShardPlan
from torch_runner.distributed.worker import WireChunk
from torch_runner.runner.model_runner import ModelRunner

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PROMPT = [5, 9, 2, 7, 1, 3]


def _logits(runner: ModelRunner, chunks) -> torch.Tensor:
    logits, _ = runner.forward_logits(chunks)
    return logits.float().cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_group_of_one_rank_runs_a_step_like_the_plain_runner(tmp_path, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path, _ = save_engine_checkpoint("llama", tmp_path)
    config = EngineConfig(device=device, dtype="float32", max_total_tokens=64)
    group = TPGroup(0, 1, torch.device(device), f"tcp://127.0.0.1:{free_port()}", 60)
    try:
        assert group.backend == ("nccl" if device == "cuda" else "gloo")
        plan = ShardPlan(0, 1, group)
        sharded = load_model(path, device=device, dtype="float32", shard=plan)
        plain = load_model(path, device=device, dtype="float32")
        runners = [ModelRunner(m, config, 4, torch.device(device), torch.float32,
                               tensor_parallel=tp) for m, tp in ((plain, None), (sharded, plan))]  # fmt: skip
        prefill = [WireChunk(PROMPT, 0, len(PROMPT), [0], True)]
        decode = [WireChunk([4], len(PROMPT), 1, [0], True)]
        want = [_logits(runners[0], step) for step in (prefill, decode)]
        got = [_logits(runners[1], step) for step in (prefill, decode)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert group.has_failed is False
    finally:
        group.close()
