"""A launched step's results on their way to the host, and the placeholders that chain steps.

Overlapped scheduling (engine_step.py) launches step N+1 before step N's tokens are on the host.
The input of a chained row is then a *placeholder* id -(i + 1): row i of step N's sampled
tokens, still on the device; `resolve_placeholders` swaps them in on the device, with no sync
(SGLang's FutureMap, vLLM's async scheduling). The sampled tokens (and logprobs) go to pinned
host memory with non-blocking copies and a CUDA event, so the host blocks only when it reads
them: `LaunchedStep.result()`, the one host-device sync of a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.fused import kernels_for

NON_FINITE_TOKEN = -1  # StepResult token id of a row whose logits were not all finite


@dataclass
class StepResult:
    """Sampled tokens of one step, in the order of the sampled chunks (NON_FINITE_TOKEN marks
    a row whose logits were not finite). `seqs` are the sampled sequences themselves."""

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    seqs: list | None = None


def placeholder(row: int) -> int:
    """The input id that stands for row `row` of the previous step's sampled tokens."""
    return -(row + 1)


def resolve_placeholders(ids: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
    """`ids` with every placeholder -(i + 1) replaced by `future[i]`, on the device (no sync)."""
    rows = (-ids - 1).clamp_(min=0)  # real ids index row 0, which `where` then ignores
    return torch.where(ids < 0, future[rows], ids)


def resolve_placeholders_(ids: torch.Tensor, future: torch.Tensor) -> None:
    """`resolve_placeholders` in place on a column of a graph's input buffer: on CUDA one
    Triton kernel (ops/fused) where the torch ops were six kernels and a copy a step."""
    kernels = kernels_for(ids)
    if kernels is not None:
        kernels.resolve_placeholders_(ids, future)
    else:
        ids.copy_(resolve_placeholders(ids, future))


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy into pinned host memory (CUDA); the tensor itself elsewhere."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


class LaunchedStep:
    """A step queued on the device: its sampled sequences now, its tokens at `result()`."""

    def __init__(self, seqs: list, token_ids=None, logprobs=None, top_logprobs=None):
        self.seqs = seqs
        self._token_ids = None if token_ids is None else _to_host(token_ids)
        self._logprobs = None if logprobs is None else _to_host(logprobs)
        self._top = None if top_logprobs is None else tuple(_to_host(t) for t in top_logprobs)
        self._event = None
        if token_ids is not None and token_ids.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        """The step's tokens as Python lists; waits for the device (once) if they are not in."""
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()  # the step's one sync: its sampled tokens reach the host
        rids = [s.request_id for s in self.seqs]
        tokens = [] if self._token_ids is None else self._token_ids.tolist()
        result = StepResult(rids, tokens, seqs=self.seqs)
        if self._logprobs is not None:
            result.logprobs = self._logprobs.tolist()
        if self._top is not None:
            ids, values = self._top
            result.top_logprobs = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        self._result = result
        return result
