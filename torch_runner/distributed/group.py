"""The tensor-parallel process group: start-up (spawned or torchrun), collectives, the step wire.

Two groups: the data group (NCCL on CUDA, gloo on CPU) carries the all-reduces and the logits
gather with `dist_timeout`, so a dead or hung rank fails the step instead of hanging it; a gloo
control group carries rank 0's pickled step inputs with a long timeout, because a worker waits
on it for as long as the server is idle. A collective failure raises RankFailure.
"""

from __future__ import annotations

import os
import pickle
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

IDLE_TIMEOUT = timedelta(days=30)  # a worker may wait this long for rank 0's next step
# rank 0's first message (the pool size) waits for every worker to finish loading its shard,
# which on a busy host or a slow disk takes longer than a step may (dist_timeout)
LOAD_TIMEOUT = timedelta(minutes=10)
# how long the ranks may take to come up and meet (each imports torch first: seconds on a busy
# host); the collectives' own timeout is dist_timeout, on a group of their own
JOIN_TIMEOUT = timedelta(seconds=60)
STOP = "stop"


class RankFailure(RuntimeError):
    """A tensor-parallel rank died, hung past dist_timeout, or a collective failed."""

    def __init__(self, message: str, group: TPGroup | None = None):
        super().__init__(message)
        if group is not None:
            group.has_failed = True  # close() then stops the workers without waiting on them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun (RANK/WORLD_SIZE set), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


class TPGroup:
    """This process's place in the group and the collectives the model and the engine use."""

    def __init__(self, rank: int, size: int, device: torch.device, init_method: str, timeout_s):
        self.rank, self.size, self.device = rank, size, device
        backend = self.backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = self.timeout = timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                    timeout=max(timeout, JOIN_TIMEOUT))  # fmt: skip
            self.compute = dist.new_group(backend=backend, timeout=timeout)  # the collectives
            self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        except Exception as exc:  # a rank that never came up: the rendezvous timed out
            raise RankFailure(f"tensor parallel rendezvous failed at rank {rank}: {exc}") from exc
        self.has_failed = False
        self.all_reduce_seconds = 0.0  # bench_tp.py reads it (only when `timing` is on)
        self.timing = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.timing:
            return self._timed_all_reduce(x)
        try:
            dist.all_reduce(x, group=self.compute)
        except Exception as exc:
            raise RankFailure(f"all-reduce failed at rank {self.rank}: {exc}", self) from exc
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise max of `x` over the ranks, in place (load time: int8 row scales)."""
        try:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.compute)
        except Exception as exc:
            raise RankFailure(f"all-reduce (max) failed at rank {self.rank}: {exc}", self) from exc
        return x

    def _timed_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import time

        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        dist.all_reduce(x, group=self.compute)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        self.all_reduce_seconds += time.perf_counter() - start
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., V/N] on every rank -> [..., V] (rank order) on every rank."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        try:
            dist.all_gather(parts, x.contiguous(), group=self.compute)
        except Exception as exc:
            raise RankFailure(f"logits gather failed at rank {self.rank}: {exc}", self) from exc
        return torch.cat(parts, dim=-1)

    def send(self, message, timeout: timedelta | None = None) -> None:
        """Rank 0: broadcast one picklable message to the workers over the control group.

        The workers wait on that group with the idle timeout, but rank 0 waits at most
        dist_timeout (or `timeout`, if longer: start-up) for them to take it (a hung worker
        fails the send, not the server)."""
        timeout = max(self.timeout, timeout or self.timeout)
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        try:
            for tensor in (size, payload):
                work = dist.broadcast(tensor, src=0, group=self.control, async_op=True)
                work.wait(timeout=timeout)
        except Exception as exc:
            raise RankFailure(
                f"a tensor parallel worker did not take the step (it exited, or did not answer "
                f"within {timeout}): {exc}",
                self,
            ) from exc

    def receive(self):
        """Ranks > 0: rank 0's next message (waits as long as rank 0 is idle)."""
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.control)
        return pickle.loads(payload.numpy().tobytes())  # noqa: S301 - rank 0 of our own group

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
