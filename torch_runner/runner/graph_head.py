"""What a decode graph runs after the decoder when the step's sampling allows: the lm_head and
the sampler, so no logits leave the graph and the step is one replay.

A `GraphHead` is the static part of a step's sampling (which paths the rows take, whether the
random rows are seeded, the bounded top-K width): it is part of the graph's key. `HeadInputs`
are the per-row parts (path, temperature, seed, top-k / top-p / min-p) as fixed device tensors
of the graph's row count; a step copies the values `SamplingBatch.build` made for its rows into
them. The graph then runs the sampler's own code (ops.sampling.sampler: `process_logits`, then
`draw_tokens` once per path, every row on it, and a per-row select), so graph and eager steps
sample alike:

- greedy and seeded rows pick exactly what the eager sampler picks (argmax; the hash contract,
  seeded-sampling.md: a seeded row's token depends only on its logits, seed and position);
- unseeded rows draw their noise from the runner's generator, which the graph registers
  (`CUDAGraph.register_generator_state`): every replay reads the generator's current offset
  and advances it by the graph's draws, so replays never repeat noise and a run is as
  reproducible from the engine's seed as eager steps are. The draws cover the graph's padded
  rows, so the tokens are a different (equally valid) sample than an eager step's.

Logprobs, logit edits (logit_bias, min_tokens, grammar masks) and penalties stay eager.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.fused import kernels_for
from ops.sampling.batch import FilterParams, RowGroup, SamplingBatch
from ops.sampling.sampler import draw_tokens, process_logits

NON_FINITE_TOKEN = -1  # launched.py's marker of a row whose logits were not all finite
_FLOAT_MAX = torch.finfo(torch.float32).max
PATH_CODES = {"greedy": 0, "plain": 1, "filtering": 2}  # HeadInputs.paths values


def is_graph_sampled(params) -> bool:
    """Rows a graph head can sample: nothing the sampler must read per step from the host (no
    logprobs, logit_bias, penalties, min_tokens (its EOS ban is a logit edit) or grammar).
    Decided before the forward, from the params; `GraphHead.for_batch` agrees."""
    return (
        not params.logprobs
        and not params.logit_bias
        and not params.has_penalties
        and not params.min_tokens
        and params.structured is None
    )


@dataclass(frozen=True)
class GraphHead:
    """The sampling structure a graph is captured for (hashable: part of the graph's key)."""

    vocab: int  # logits columns sampled over (the tokenizer's vocabulary)
    # the random rows' path: "plain" (temperature only), "filtering" (top-k / top-p / min-p)
    # or "plain+filtering"; "greedy": every row greedy
    kind: str
    # filtering: candidate width, FilterParams.width rounded up to a power of two (a seeded
    # row's token does not depend on the width: the hash contract, seeded-sampling.md)
    width: int = 0
    needs_mass: bool = False  # filtering: some row has top_p < 1
    seeding: str = "seeded"  # the random rows: all hashed, all from the generator, or "mixed"
    has_greedy: bool = False  # besides random rows, some greedy ones

    @property
    def paths(self) -> tuple[str, ...]:
        """The random paths the graph draws on ("greedy": none)."""
        return () if self.kind == "greedy" else tuple(self.kind.split("+"))

    @property
    def draws_noise(self) -> bool:
        """Some row draws from the generator (the graph must register it)."""
        return self.kind != "greedy" and self.seeding != "seeded"

    @classmethod
    def for_batch(cls, batch: SamplingBatch, vocab: int) -> GraphHead | None:
        """The head that samples `batch` as ops.sample would, or None (the eager sampler)."""
        if batch.penalties is not None or batch.logit_edits is not None or batch.needs_logprobs:
            return None
        if batch.greedy is not None and batch.greedy.rows is None:
            return cls(vocab, "greedy")
        named = (("plain", batch.plain), ("filtering", batch.filtering))
        groups = [g for _, g in named if g is not None]
        seeding = "mixed"
        if all(g.is_all_seeded for g in groups):
            seeding = "seeded"
        elif all(g.seeds is None for g in groups):
            seeding = "unseeded"
        kind = "+".join(name for name, g in named if g is not None)
        has_greedy = batch.greedy is not None
        if batch.filtering is None:
            return cls(vocab, kind, seeding=seeding, has_greedy=has_greedy)
        width = batch.filter_params.width  # max(top_k) of the batch, or the vocabulary
        if width < vocab:  # a power of two: a few graphs, not one per max(top_k) seen
            width = min(1 << (width - 1).bit_length(), vocab)
        return cls(vocab, kind, width, batch.filter_params.needs_mass, seeding, has_greedy)


class HeadInputs:
    """A graph's per-row sampling tensors [rows]; rows past the live ones keep valid values."""

    def __init__(self, head: GraphHead, rows: int, device):
        self.head, self.rows = head, rows
        f32 = dict(dtype=torch.float32, device=device)
        self.paths = torch.full((rows,), PATH_CODES[head.paths[0]], dtype=torch.int8,
                                device=device)  # fmt: skip
        self.temperatures = torch.ones(rows, **f32)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=device)
        self.is_seeded = torch.zeros(rows, dtype=torch.bool, device=device)
        self.top_ks = torch.full((rows,), head.vocab, dtype=torch.int64, device=device)
        self.top_ps = torch.ones(rows, **f32)
        self.min_ps = torch.zeros(rows, **f32)

    def load(self, batch: SamplingBatch) -> None:
        """Copy the live rows' values (device to device, queued: no host sync). A row's values
        for paths it does not take are stale; only its own path's pick is kept."""
        b, head = batch.num_rows, self.head
        self.temperatures[:b].copy_(batch.temperatures)
        # only what the head reads: a one-path, one-seeding head needs no paths or flags
        selects = head.has_greedy or len(head.paths) > 1
        for path, group in (("greedy", batch.greedy), ("plain", batch.plain),
                            ("filtering", batch.filtering)):  # fmt: skip
            if group is None:
                continue
            if selects:
                _fill(self.paths, group.rows, b, PATH_CODES[path])
            if path == "greedy":
                continue
            if group.seeds is not None:
                _put(self.seeds, group.rows, b, group.seeds)
            if head.seeding != "mixed":
                continue
            if group.is_seeded is not None:
                _put(self.is_seeded, group.rows, b, group.is_seeded)
            else:
                _fill(self.is_seeded, group.rows, b, group.is_all_seeded)
        if batch.filter_params is not None:
            fp, rows = batch.filter_params, batch.filtering.rows
            _put(self.top_ks, rows, b, fp.top_ks)
            _put(self.top_ps, rows, b, fp.top_ps)
            _put(self.min_ps, rows, b, fp.min_ps)

    def batch(self, path: str) -> SamplingBatch:
        """The SamplingBatch over these tensors with every row on `path` ("plain" or
        "filtering") and the head's seeding."""
        head, seeding = self.head, self.head.seeding
        seeds = None if seeding == "unseeded" else self.seeds
        is_seeded = self.is_seeded if seeding == "mixed" else None
        group = RowGroup(None, self.rows, seeds, is_seeded, seeding == "seeded")
        filtering = path == "filtering"
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


def _put(dst: torch.Tensor, rows, b: int, values: torch.Tensor) -> None:
    """dst[rows] = values (rows None: the first b)."""
    if rows is None:
        dst[:b].copy_(values)
    else:
        dst.index_copy_(0, rows, values)


def _fill(dst: torch.Tensor, rows, b: int, value) -> None:
    if rows is None:
        dst[:b].fill_(value)
    else:
        dst.index_fill_(0, rows, value)


def sample_rows(logits, head: GraphHead, inputs: HeadInputs, positions, generator=None):
    """Token ids [B] of a random head: what ops.sample picks for each row's path. Every path the
    head has runs over every row (no host-sized row groups in a graph); `inputs.paths` keeps
    each row's own pick. `generator`: the unseeded rows' noise."""
    batches = [inputs.batch(path) for path in head.paths]
    scaled = process_logits(logits, batches[0])  # the temperatures: the same for every path
    chosen = None
    for path, batch in zip(head.paths, batches):
        picks = draw_tokens(scaled, batch, positions, generator)
        if chosen is None:
            chosen = picks
        else:
            chosen = torch.where(inputs.paths == PATH_CODES[path], picks, chosen)
    if head.has_greedy:  # the sampler's greedy rows: argmax of the same scaled logits (T = 1)
        greedy = inputs.paths == PATH_CODES["greedy"]
        chosen = torch.where(greedy, scaled.max(dim=-1).indices, chosen)
    return chosen


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


def run_head(model, hidden, head: GraphHead, positions, head_inputs: HeadInputs | None,
             generator=None):  # fmt: skip
    """hidden [B, 1, H] -> (token ids [B] with NON_FINITE_TOKEN, picks [B]); `positions` [B]
    are the sampled tokens' positions (the seeded noise's key)."""
    logits = model.compute_logits(hidden[:, 0])[:, : head.vocab]  # [B, V]
    if head.kind == "greedy":
        return greedy_tokens(logits)
    picks = sample_rows(logits, head, head_inputs, positions, generator)
    return _flag_non_finite(logits, picks), picks
