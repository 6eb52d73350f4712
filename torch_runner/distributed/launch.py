"""Starting the ranks: spawned workers on one host, or every rank launched by torchrun.

Without RANK/WORLD_SIZE in the environment, rank 0 (the engine's process) spawns ranks 1..N-1
with torch.multiprocessing and rendezvouses with them on MASTER_ADDR:MASTER_PORT (default
127.0.0.1 and a free port). Under torchrun every process runs the same entry point; rank 0 goes
on to be the engine and ranks > 0 never return from `start_tensor_parallel`: they serve steps
(worker.py) and exit when rank 0 stops.
"""

from __future__ import annotations

import atexit
import logging
import os

import torch

from bridge import resolve_device
from models.loader import read_config
from torch_runner.distributed.checks import (
    check_fp8_shards,
    check_int4_shards,
    check_moe_shards,
    check_shardable,
)
from torch_runner.distributed.group import STOP, RankFailure, TPGroup, free_port, torchrun_env
from torch_runner.distributed.shard import ShardPlan

logger = logging.getLogger(__name__)


def rank_device(spec: str, local_rank: int) -> torch.device:
    """This rank's device: cuda:<local rank> on CUDA, else the resolved device."""
    device = resolve_device(spec)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ValueError(f"tensor parallel runs on cuda or cpu; device={spec!r} is {device.type}")
    return device


def check_launch(config, path: str) -> None:
    """Every bad combination, in one line, before a process starts or a weight is read."""
    from pathlib import Path

    from models.gguf_loader import find_gguf, sidecar_folder

    size = config.tensor_parallel_size
    gguf = find_gguf(Path(path).expanduser())
    folder = sidecar_folder(gguf) if gguf is not None else Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"tensor_parallel_size={size} needs a safetensors model folder or a GGUF file; "
            f"{path!r} is neither"
        )
    raw = read_config(folder)
    check_shardable(raw, size)
    check_moe_shards(raw, size, config.enable_expert_parallel, config.moe_weights)
    if config.quantization == "int4":
        check_int4_shards(raw, size)
    check_fp8_shards(raw, size)
    if resolve_device(config.device).type == "cuda" and torchrun_env() is None:
        count = torch.cuda.device_count()
        if size > count:
            raise ValueError(
                f"tensor_parallel_size={size} needs {size} CUDA devices; {count} visible"
            )


class TensorParallel:
    """Rank 0's handle: the group, this rank's shard plan, and the spawned workers."""

    def __init__(self, group: TPGroup, plan: ShardPlan, processes: list):
        self.group, self.plan, self.processes = group, plan, processes
        self.is_closed = False
        atexit.register(self.close)

    def check_alive(self) -> None:
        """A spawned worker that exited is a RankFailure before the step, not a hang in it."""
        for rank, proc in enumerate(self.processes, start=1):
            if not proc.is_alive():
                raise RankFailure(
                    f"tensor parallel rank {rank} exited (exit code {proc.exitcode}); "
                    "the engine cannot continue"
                )

    def send_step(self, chunks) -> None:
        """The step's inputs to every worker: per chunk its tokens, start, length, block table
        and whether it is sampled (the workers' runners build the same tensors from them)."""
        self.group.send(
            [
                (
                    c.seq.token_slice(c.start, c.end),
                    c.start,
                    c.num_tokens,
                    list(c.seq.block_table),
                    c.is_sampled,
                )  # fmt: skip
                for c in chunks
            ]
        )

    def close(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        try:
            if not self.group.has_failed and all(p.is_alive() for p in self.processes):
                self.group.send(STOP)
        except RankFailure:
            pass
        wait = 1 if self.group.has_failed else 10  # a hung rank is not waited for twice
        for proc in self.processes:
            proc.join(timeout=wait)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)  # reaped: is_alive() is False once close() returns
        self.group.close()


def start_tensor_parallel(config, path: str) -> TensorParallel | None:
    """None for tensor_parallel_size 1; else this process becomes rank 0 (see the module doc)."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    check_launch(config, path)
    env = torchrun_env()
    if env is not None:
        rank, world, local_rank = env
        if world != size:
            raise ValueError(
                f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={world} ranks"
            )
        init = "env://"
        if rank > 0:
            from torch_runner.distributed.worker import run_worker

            run_worker(config, path, rank, size, init, local_rank)
            raise SystemExit(0)
        processes = []
    else:
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT") or free_port())
        init = f"tcp://{addr}:{port}"
        processes = _spawn_workers(config, path, size, init)
    device = rank_device(config.device, 0)
    try:
        group = TPGroup(0, size, device, init, config.dist_timeout)
    except RankFailure:
        for proc in processes:
            proc.kill()
        raise
    return TensorParallel(
        group, ShardPlan(0, size, group, expert_parallel=config.enable_expert_parallel), processes
    )


def _spawn_workers(config, path: str, size: int, init: str) -> list:
    from torch_runner.distributed.worker import spawned_worker

    context = torch.multiprocessing.get_context("spawn")
    threads = torch.get_num_threads()
    processes = []
    for rank in range(1, size):
        proc = context.Process(
            target=spawned_worker,
            args=(config, path, rank, size, init, threads),
            name=f"torch_runner-tp{rank}",
            daemon=True,
        )
        proc.start()
        processes.append(proc)
    logger.info("tensor parallel: spawned %d worker rank(s), rendezvous %s", size - 1, init)
    return processes
