"""What a decode graph runs after the decoder when the step's sampling allows: the lm_head and
the sampler, so no logits leave the graph and the step is one replay.

A `GraphHead` is the static part of a step's sampling (which path every row takes, the bounded
top-K width): it is part of the graph's key. `HeadInputs` are the per-row parts (temperature,
seed, top-k / top-p / min-p) as fixed device tensors of the graph's row count; a step copies
the values `SamplingBatch.build` made for its rows into them. The graph then calls the sampler
itself (ops.sample) on a `SamplingBatch` over those tensors, so graph and eager steps run the
same code. Heads exist for all-greedy batches and for batches whose rows all take one random
path *seeded* (the hash contract: no generator state, so replays pick what eager steps pick);
unseeded rows draw from the runner's generator and stay eager, as do logprobs, logit edits
(logit_bias, min_tokens, grammar masks) and penalties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.fused import kernels_for
from ops.sampling.batch import FilterParams, RowGroup, SamplingBatch
from ops.sampling.sampler import sample

NON_FINITE_TOKEN = -1  # launched.py's marker of a row whose logits were not all finite
_FLOAT_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class GraphHead:
    """The sampling structure a graph is captured for (hashable: part of the graph's key)."""

    vocab: int  # logits columns sampled over (the tokenizer's vocabulary)
    kind: str  # "greedy", "plain" (temperature only) or "filtering" (top-k / top-p / min-p)
    # filtering: candidate width, FilterParams.width rounded up to a power of two (a seeded
    # row's token does not depend on the width: the hash contract, seeded-sampling.md)
    width: int = 0
    needs_mass: bool = False  # filtering: some row has top_p < 1

    @classmethod
    def for_batch(cls, batch: SamplingBatch, vocab: int) -> GraphHead | None:
        """The head that samples `batch` as ops.sample would, or None (the eager sampler)."""
        if batch.penalties is not None or batch.logit_edits is not None or batch.needs_logprobs:
            return None
        groups = [g for g in (batch.greedy, batch.plain, batch.filtering) if g is not None]
        if len(groups) != 1 or groups[0].rows is not None:  # rows split over paths
            return None
        if batch.greedy is not None:
            return cls(vocab, "greedy")
        if not groups[0].is_all_seeded:  # the generator's draws stay eager
            return None
        if batch.plain is not None:
            return cls(vocab, "plain")
        width = batch.filter_params.width  # max(top_k) of the batch, or the vocabulary
        if width < vocab:  # a power of two: a few graphs, not one per max(top_k) seen
            width = min(1 << (width - 1).bit_length(), vocab)
        return cls(vocab, "filtering", width, batch.filter_params.needs_mass)


class HeadInputs:
    """A graph's per-row sampling tensors [rows]; rows past the live ones keep valid values."""

    def __init__(self, head: GraphHead, rows: int, device):
        self.head, self.rows = head, rows
        f32 = dict(dtype=torch.float32, device=device)
        self.temperatures = torch.ones(rows, **f32)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=device)
        self.top_ks = torch.full((rows,), head.vocab, dtype=torch.int64, device=device)
        self.top_ps = torch.ones(rows, **f32)
        self.min_ps = torch.zeros(rows, **f32)

    def load(self, batch: SamplingBatch) -> None:
        """Copy the live rows' values (device to device, queued: no host sync)."""
        b = batch.num_rows
        group = batch.plain if batch.plain is not None else batch.filtering
        self.temperatures[:b].copy_(batch.temperatures)
        self.seeds[:b].copy_(group.seeds)
        if batch.filter_params is not None:
            fp = batch.filter_params
            self.top_ks[:b].copy_(fp.top_ks)
            self.top_ps[:b].copy_(fp.top_ps)
            self.min_ps[:b].copy_(fp.min_ps)

    def batch(self) -> SamplingBatch:
        """The SamplingBatch over these tensors (the structure of `head`, every row seeded)."""
        head = self.head
        group = RowGroup(None, self.rows, self.seeds, None, True)
        filtering = head.kind == "filtering"
        params = None
        if filtering:
            params = FilterParams(self.top_ks, self.top_ps, self.min_ps, head.width,
                                  head.needs_mass)  # fmt: skip
        return SamplingBatch(
            num_rows=self.rows, vocab_size=head.vocab, temperatures=self.temperatures,
            greedy=None, plain=None if filtering else group, filtering=group if filtering else None,
            filter_params=params, penalties=None, logit_edits=None, needs_logprobs=False,
            num_top_logprobs=0,
        )  # fmt: skip


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's all-greedy step on logits [B, V]: (token ids [B], NON_FINITE_TOKEN where a
    row holds NaN/inf; picks [B], what a chained row reads). The torch ops are the reference
    (ops.sample's greedy path: argmax of nan_to_num(fp32), first index on ties); on CUDA one
    Triton kernel pair reads the bf16 logits once (ops/fused greedy_pick; the eager argmax took
    28 us of a 1.15 ms 1B batch-1 step on an H200)."""
    kernels = kernels_for(logits)
    if kernels is not None:
        return kernels.greedy_pick(logits)
    x = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=_FLOAT_MAX)
    picks = x.max(dim=-1).indices
    return _flag_non_finite(logits, picks), picks


def _flag_non_finite(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """model_runner's flag: an fp32 row sum is NaN/inf iff some logit is."""
    is_finite = torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))  # [B]
    return torch.where(is_finite, token_ids, NON_FINITE_TOKEN)


def run_head(model, hidden, head: GraphHead, positions, head_inputs: HeadInputs | None):
    """hidden [B, 1, H] -> (token ids [B] with NON_FINITE_TOKEN, picks [B]); `positions` [B]
    are the sampled tokens' positions (the seeded noise's key)."""
    logits = model.compute_logits(hidden[:, 0])[:, : head.vocab]  # [B, V]
    if head.kind == "greedy":
        return greedy_tokens(logits)
    picks = sample(logits, head_inputs.batch(), positions).token_ids
    return _flag_non_finite(logits, picks), picks
