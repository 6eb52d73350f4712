"""SamplingBatch: per-row sampling parameters as device tensors, built once per step.

Everything the sampler branches on is decided here, on the host, from the Python params (which
rows are greedy, plain temperature or filtering; seeded or not; bounded top-K width; which
features any row uses). `sample` then runs without a host sync, and features no row uses cost
nothing: their tensors are None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.sampling.params import SamplingParamError, SamplingParams
from ops.sampling.seeded_hash import to_signed64

MAX_BOUNDED_TOP_K = 1024  # filtering works on [B, K] candidates when every row's top_k fits
DEFAULT_DETERMINISTIC_SEED = 42


def _tensor(values, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, device=device)` without blocking the host on CUDA: a copy from
    pageable memory waits for the work queued before it (with overlapped scheduling, the
    whole forward in flight); from pinned memory it is queued like a kernel."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class RowGroup:
    """Rows that take one sampling path. `rows` None means every row of the batch, in order."""

    rows: torch.Tensor | None  # [R] int64 indices into the batch
    size: int
    seeds: torch.Tensor | None  # [R] int64 (uint64 bits); None when no row of the group is seeded
    is_seeded: torch.Tensor | None  # [R] bool; None when all or none are seeded
    is_all_seeded: bool

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.rows is None else tensor.index_select(0, self.rows)

    def subset(self, picks: torch.Tensor) -> RowGroup:
        """The group's rows at `picks` (indices into this group), as a group of the batch."""
        rows = picks if self.rows is None else self.rows.index_select(0, picks)
        seeds = None if self.seeds is None else self.seeds.index_select(0, picks)
        is_seeded = None if self.is_seeded is None else self.is_seeded.index_select(0, picks)
        return RowGroup(rows, picks.numel(), seeds, is_seeded, self.is_all_seeded)


@dataclass
class FilterParams:
    """top-k / top-p / min-p of the filtering rows, and the candidate width W."""

    top_ks: torch.Tensor  # [F] int64, -1 mapped to the vocabulary size
    top_ps: torch.Tensor  # [F] fp32
    min_ps: torch.Tensor  # [F] fp32
    width: int  # W: max top_k when every row has top_k <= MAX_BOUNDED_TOP_K, else V
    needs_mass: bool  # some row has top_p < 1 (needs the row's total probability mass)


@dataclass
class Penalties:
    """Penalty parameters and token statistics, only for features some row uses."""

    repetition: torch.Tensor | None  # [B] fp32
    seen: torch.Tensor | None  # [B, V] bool: token occurs in prompt + output
    presence: torch.Tensor | None  # [B] fp32
    frequency: torch.Tensor | None  # [B] fp32
    counts: torch.Tensor | None  # [B, V] fp32: occurrences in the output


@dataclass
class SamplingBatch:
    """The sampler's view of one step: per-row tensors on the logits' device."""

    num_rows: int
    vocab_size: int
    temperatures: torch.Tensor | None  # [B] fp32 (1.0 on greedy rows); None when all greedy
    greedy: RowGroup | None
    plain: RowGroup | None  # temperature-only rows: Gumbel-max on the scaled logits
    filtering: RowGroup | None
    filter_params: FilterParams | None
    penalties: Penalties | None
    logit_edits: torch.Tensor | None  # [B, V] fp32 additive (logit_bias, masks; -inf forbids)
    needs_logprobs: bool
    num_top_logprobs: int

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
        edit_rows: list[torch.Tensor | None] | None = None,
        deterministic: bool = False,
        eos_token_ids: list[int] | None = None,
    ) -> SamplingBatch:
        """Build the batch for one step.

        A row is seeded when its request has a seed, or every row when `deterministic` (the seed
        then defaults to 42). `edit_rows[i]` is an additive [V] row (grammar mask, -inf =
        forbidden). Rows that have produced fewer than `min_tokens` tokens get -inf on
        `eos_token_ids` and their stop_token_ids (unless ignore_eos skips EOS).
        """
        num_rows = len(params)
        if len(prompt_ids) != num_rows or len(output_ids) != num_rows:
            raise ValueError(
                f"params, prompt_ids and output_ids must have one entry per row; got {num_rows}, "
                f"{len(prompt_ids)}, {len(output_ids)}"
            )
        if edit_rows is not None and len(edit_rows) != num_rows:
            raise ValueError(
                f"edit_rows must have one entry per row; got {len(edit_rows)} for {num_rows} rows"
            )
        device = torch.device(device)
        greedy, plain, filtering, seeds = [], [], [], []
        for i, p in enumerate(params):
            (greedy if p.is_greedy else filtering if p.is_filtering else plain).append(i)
            seed = p.seed
            if seed is None and deterministic:
                seed = DEFAULT_DETERMINISTIC_SEED
            seeds.append(seed)
        is_all_greedy = len(greedy) == num_rows
        temperatures = None
        if not is_all_greedy:
            temps = [1.0 if p.is_greedy else p.temperature for p in params]
            temperatures = _tensor(temps, dtype=torch.float32, device=device)
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            temperatures=temperatures,
            greedy=_group(greedy, num_rows, None, device),
            plain=_group(plain, num_rows, seeds, device),
            filtering=_group(filtering, num_rows, seeds, device),
            filter_params=_filter_params([params[i] for i in filtering], vocab_size, device),
            penalties=_penalties(params, prompt_ids, output_ids, vocab_size, device),
            logit_edits=_logit_edits(
                params, output_ids, vocab_size, device, edit_rows, eos_token_ids
            ),
            needs_logprobs=any(p.logprobs for p in params),
            num_top_logprobs=min(max((p.top_logprobs for p in params), default=0), vocab_size),
        )


def _group(
    rows: list[int], num_rows: int, seeds: list[int | None] | None, device
) -> RowGroup | None:
    if not rows:
        return None
    index = None if len(rows) == num_rows else _tensor(rows, dtype=torch.int64, device=device)
    row_seeds = [None] * len(rows) if seeds is None else [seeds[i] for i in rows]
    flags = [s is not None for s in row_seeds]
    seed_tensor = flag_tensor = None
    if any(flags):
        values = [to_signed64(s) if s is not None else 0 for s in row_seeds]
        seed_tensor = _tensor(values, dtype=torch.int64, device=device)
        if not all(flags):
            flag_tensor = _tensor(flags, dtype=torch.bool, device=device)
    return RowGroup(index, len(rows), seed_tensor, flag_tensor, all(flags))


def _filter_params(params: list[SamplingParams], vocab_size: int, device) -> FilterParams | None:
    if not params:
        return None
    top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
    bounded = all(p.top_k != -1 and p.top_k <= MAX_BOUNDED_TOP_K for p in params)
    return FilterParams(
        top_ks=_tensor(top_ks, dtype=torch.int64, device=device),
        top_ps=_tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        min_ps=_tensor([p.min_p for p in params], dtype=torch.float32, device=device),
        width=max(top_ks) if bounded else vocab_size,
        needs_mass=any(p.top_p < 1.0 for p in params),
    )


def _flat_index(
    rows: list[int], *id_lists: list[list[int]], vocab_size: int, device
) -> torch.Tensor:
    """Flat [B * V] positions of every (row, token) pair, in one host-to-device tensor. Ids
    outside the logits' width (tokenizer extras) cannot be penalised and are skipped."""
    flat = [
        r * vocab_size + t for r in rows for ids in id_lists for t in ids[r] if 0 <= t < vocab_size
    ]
    return _tensor(flat, dtype=torch.int64, device=device)


def _penalties(params, prompt_ids, output_ids, vocab_size: int, device) -> Penalties | None:
    num_rows = len(params)
    uses_repetition = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    uses_counts = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if not uses_repetition and not uses_counts:
        return None
    repetition = seen = presence = frequency = counts = None
    if uses_repetition:
        repetition = _tensor(
            [p.repetition_penalty for p in params], dtype=torch.float32, device=device
        )
        seen = torch.zeros(num_rows * vocab_size, dtype=torch.bool, device=device)
        seen[
            _flat_index(
                uses_repetition, prompt_ids, output_ids, vocab_size=vocab_size, device=device
            )
        ] = True
        seen = seen.view(num_rows, vocab_size)
    if uses_counts:
        presence = _tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)
        frequency = _tensor(
            [p.frequency_penalty for p in params], dtype=torch.float32, device=device
        )
        index = _flat_index(uses_counts, output_ids, vocab_size=vocab_size, device=device)
        counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
        counts.index_add_(0, index, torch.ones(index.numel(), dtype=torch.float32, device=device))
        counts = counts.view(num_rows, vocab_size)
    return Penalties(repetition, seen, presence, frequency, counts)


def _logit_edits(
    params, output_ids, vocab_size: int, device, edit_rows, eos_token_ids
) -> torch.Tensor | None:
    """One additive [B, V] row per request: logit_bias, min_tokens bans, grammar masks."""
    flat, values = [], []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            if token >= vocab_size:
                raise SamplingParamError(
                    "logit_bias", f"token id {token} is out of range; allowed: 0..{vocab_size - 1}"
                )
            flat.append(i * vocab_size + token)
            values.append(bias)
        if len(output_ids[i]) < p.min_tokens:
            banned = list(p.stop_token_ids or []) + (
                [] if p.ignore_eos else list(eos_token_ids or [])
            )
            for token in banned:
                if token < vocab_size:
                    flat.append(i * vocab_size + token)
                    values.append(float("-inf"))
    has_rows = edit_rows is not None and any(row is not None for row in edit_rows)
    if not flat and not has_rows:
        return None
    edits = torch.zeros(len(params) * vocab_size, dtype=torch.float32, device=device)
    if flat:
        index = _tensor(flat, dtype=torch.int64, device=device)
        edits.index_add_(0, index, _tensor(values, dtype=torch.float32, device=device))
    edits = edits.view(len(params), vocab_size)
    if has_rows:
        for i, row in enumerate(edit_rows):
            if row is not None:
                if row.shape[-1] != vocab_size:
                    raise ValueError(
                        f"edit_rows[{i}] has {row.shape[-1]} columns; the vocabulary has {vocab_size}"
                    )
                edits[i] += row.to(device=device, dtype=torch.float32).reshape(vocab_size)
    return edits
