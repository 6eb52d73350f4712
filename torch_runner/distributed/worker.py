"""Ranks > 0: load this rank's shard, then run every step rank 0 broadcasts, until STOP.

A worker never schedules or samples: it rebuilds the step's chunks from the wire (WireChunk has
the fields the runner reads), runs the same forward (its heads, its KV), takes part in the
all-reduces and the logits gather, and waits for the next step.
"""

from __future__ import annotations

import logging
import sys

import torch

from models import load_model
from torch_runner.distributed.group import STOP, TPGroup
from torch_runner.distributed.shard import ShardPlan
from torch_runner.gc_heap import freeze_startup_heap
from torch_runner.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class WireChunk:
    """One scheduled chunk as a worker sees it (also its own `seq`)."""

    __slots__ = ("tokens", "start", "num_tokens", "block_table", "is_sampled")
    restore_from = None  # tensor parallel keeps SWA layers in the paged pool: no payloads

    def __init__(self, tokens, start, num_tokens, block_table, is_sampled):
        self.tokens, self.start, self.num_tokens = tokens, start, num_tokens
        self.block_table, self.is_sampled = block_table, is_sampled

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def seq(self) -> WireChunk:
        return self

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens  # the wire carries exactly [chunk.start, chunk.end)


def run_worker(config, path: str, rank: int, size: int, init: str, local_rank: int) -> None:
    from torch_runner.distributed.launch import rank_device

    device = rank_device(config.device, local_rank)
    group = TPGroup(rank, size, device, init, config.dist_timeout)
    plan = ShardPlan(rank, size, group, expert_parallel=config.enable_expert_parallel)
    try:
        loaded = load_model(path, device=device, dtype=config.dtype,
                            load_format=config.load_format, moe_weights=config.moe_weights,
                            quantization=config.quantization, shard=plan)  # fmt: skip
        num_blocks = group.receive()
        dtype = next(loaded.model.parameters()).dtype
        runner = ModelRunner(loaded, config, num_blocks, device, dtype, tensor_parallel=plan)
        freeze_startup_heap()  # this rank's process is ours alone: as the server after warm-up
        while (message := group.receive()) != STOP:
            runner.forward_logits([WireChunk(*fields) for fields in message])
    finally:
        group.close()


def spawned_worker(config, path: str, rank: int, size: int, init: str, threads: int) -> None:
    """torch.multiprocessing target: one rank on this host; any failure exits non-zero."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(threads)
    try:
        run_worker(config, path, rank, size, init, local_rank=rank)
    except Exception as exc:
        print(f"torch_runner tensor parallel rank {rank}: {type(exc).__name__}: {exc}",
              file=sys.stderr)  # fmt: skip
        sys.exit(1)
