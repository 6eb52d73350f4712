"""Temperature-only rows: one draw from softmax(scaled) over the whole vocabulary.

These rows pay for the full vocabulary every step, so each kind has its own cheaper exact form:
  unseeded  on CPU, inverse CDF: softmax, an in-place cumsum and one uniform per row from
            `generator` (2 passes instead of Gumbel-max's [R, V] uniforms + two logs: the CPU
            uniform generator alone cost ~11 ms at [64, 49152]). Exact to float32 resolution
            (cumsum accumulates in double on CPU; a token's probability is off by at most ~2^-24
            of the row mass), reproducible under a fixed generator state. On devices, Gumbel-max.
  seeded    Gumbel-max with the contract's hash noise, argmax(scaled + g). The clamp bounds
            g < GUMBEL_BOUND, so a token j can only win if scaled_j + GUMBEL_BOUND reaches the
            key of the row's top-logit token. On CPU (where reading a tensor is no device sync)
            only those candidates are hashed; rows whose candidates exceed a quarter of the
            vocabulary (flat rows, high temperature) hash everything. Same token as the full
            computation, bit for bit: same noise per (seed, position, token), same keys, ties
            to the lowest id as `max(dim)` does.
"""

from __future__ import annotations

import torch

from ops.sampling_hash import (
    finish_hash,
    finish_words_,
    neg_gumbel_,
    neg_gumbel_from_hash,
    row_prefix_hash,
    token_words,
)

# u <= 1 - 2^-24 gives g = -log(-log(u)) <= 16.64; 17 leaves room for float32 rounding.
GUMBEL_BOUND = 17.0
MAX_CANDIDATE_FRACTION = 0.25  # above it the per-candidate gathers cost more than hashing all


def draw_plain(rows: torch.Tensor, group, positions: torch.Tensor, generator) -> torch.Tensor:
    """Token ids [R] for the temperature-only rows `rows` [R, V] (scaled, finite or -inf) of
    RowGroup `group`; `positions` [B] are the batch's."""
    if group.seeds is None:
        return unseeded_draw(rows, generator)
    prefix = row_prefix_hash(group.seeds, group.take(positions))  # [R] int32
    if group.is_all_seeded:
        return seeded_draw(rows, prefix)
    if rows.device.type != "cpu":  # no host sync: both draws for every row, keep the right one
        seeded, unseeded = seeded_draw(rows, prefix), unseeded_draw(rows, generator)
        return torch.where(group.is_seeded, seeded, unseeded)
    chosen = torch.empty(rows.shape[0], dtype=torch.int64)
    picks = group.is_seeded.nonzero().flatten()
    chosen[picks] = seeded_draw(rows.index_select(0, picks), prefix.index_select(0, picks))
    others = (~group.is_seeded).nonzero().flatten()
    chosen[others] = inverse_cdf_draw(rows.index_select(0, others), generator)
    return chosen


def unseeded_draw(rows: torch.Tensor, generator) -> torch.Tensor:
    """[R] int64 drawn from softmax(rows) with `generator`: inverse CDF on CPU; Gumbel-max on
    devices, where the [R, V] uniform and logs are cheap fused kernels (measured 0.16 ms vs
    0.23 ms for the inverse CDF at [64, 49152] on an H200)."""
    if rows.device.type == "cpu":
        return inverse_cdf_draw(rows, generator)
    noise = neg_gumbel_(torch.rand(rows.shape, generator=generator, device=rows.device))
    return torch.sub(rows, noise, out=noise).max(dim=-1).indices  # u = 0: -g = +inf, loses


def inverse_cdf_draw(rows: torch.Tensor, generator) -> torch.Tensor:
    """[R] int64 with P(i) = softmax(rows)[i]: the first id whose cumulative mass exceeds u * Z.

    A token of zero weight (-inf) never spans the target, and the target is kept below the row's
    total, so the id is always a finite-logit token; rows with no finite logit give NaN masses
    and an arbitrary in-range id.
    """
    cdf = torch.softmax(rows, dim=-1).cumsum_(dim=-1)  # [R, V]
    total = cdf[:, -1:]  # [R, 1]
    u = torch.rand(total.shape, generator=generator, device=rows.device)
    target = torch.minimum(u.mul_(total), total.nextafter(torch.zeros_like(total)))
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return ids.clamp_(max=rows.shape[-1] - 1)


def seeded_draw(rows: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """argmax(rows + g) [R] with g the hash noise of per-row `prefix` [R] and the token id."""
    if rows.device.type != "cpu":
        return full_seeded_draw(rows, prefix)
    top, top_ids = rows.max(dim=-1)  # [R]
    # The top-logit token's key bounds the winner's key from below; only tokens within
    # GUMBEL_BOUND of it can reach it (margin: |best| * 2^-16 covers float32 rounding).
    best = top - neg_gumbel_from_hash(finish_hash(prefix, top_ids[:, None]))[:, 0]
    floor = best - (best.abs() * 2.0**-16 + GUMBEL_BOUND)  # [R]; -inf: no finite logit
    flat = (rows >= floor[:, None]).view(-1).nonzero().squeeze(1)  # [N] candidates, row-major
    row_ids = flat.div(rows.shape[-1], rounding_mode="floor")
    is_wide = (
        torch.bincount(row_ids, minlength=rows.shape[0]) > MAX_CANDIDATE_FRACTION * rows.shape[-1]
    )
    if not is_wide.any():
        return _candidates_draw(rows, prefix, flat, row_ids)
    # flat rows (high temperature): hashing every token beats the per-candidate gathers
    chosen = torch.empty(rows.shape[0], dtype=torch.int64)
    wide = is_wide.nonzero().squeeze(1)
    chosen[wide] = full_seeded_draw(rows.index_select(0, wide), prefix.index_select(0, wide))
    keep = (~is_wide).index_select(0, row_ids)  # candidates of the narrow rows
    narrow = _candidates_draw(rows, prefix, flat[keep], row_ids[keep])
    return torch.where(is_wide, chosen, narrow)


def _candidates_draw(rows, prefix, flat, row_ids) -> torch.Tensor:
    """Gumbel-max over the candidates `flat` [N] (flat indices into `rows` [R, V], row-major;
    `row_ids` [N] their rows). Rows without candidates get id V (callers never keep them)."""
    num_rows, vocab = rows.shape
    token_ids = flat - row_ids * vocab
    words = token_words(torch.arange(vocab))  # [V]: gathered, not recomputed per candidate
    h = prefix.index_select(0, row_ids).bitwise_xor_(words.index_select(0, token_ids))  # [N]
    noise = neg_gumbel_from_hash(finish_words_(h))
    keys = rows.reshape(-1).index_select(0, flat).sub_(noise)  # [N], as the full path does
    row_best = keys.new_full((num_rows,), float("-inf"))
    row_best.scatter_reduce_(0, row_ids, keys, "amax")
    # first id among equal keys, as max(dim) picks
    winners = torch.where(keys == row_best.index_select(0, row_ids), token_ids, vocab)
    chosen = torch.full((num_rows,), vocab, dtype=torch.int64)
    return chosen.scatter_reduce_(0, row_ids, winners, "amin")


def full_seeded_draw(rows: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """argmax(rows + g) [R] hashing every (row, token): the device path and the wide rows."""
    token_ids = torch.arange(rows.shape[-1], device=rows.device)
    noise = neg_gumbel_from_hash(finish_hash(prefix, token_ids))  # [R, V] = -g
    return torch.sub(rows, noise, out=noise).max(dim=-1).indices
