"""Temperature-only rows: one draw from softmax(scaled) over the whole vocabulary.

These rows pay for the full vocabulary every step, so each kind has its own cheaper exact form:
  unseeded  on CPU, inverse CDF: softmax, an in-place cumsum and one uniform per row from
            `generator` (2 passes instead of Gumbel-max's [R, V] uniforms + two logs: the CPU
            uniform generator alone cost ~11 ms at [64, 49152]). Exact to float32 resolution
            (cumsum accumulates in double on CPU; a token's probability is off by at most ~2^-24
            of the row mass), reproducible under a fixed generator state. On devices, Gumbel-max.
  seeded    Gumbel-max with the contract's hash noise, argmax(scaled + g), every token hashed
            (int32 words, in place); on CPU in cache-sized column chunks. Bit for bit the noise,
            keys and token of the whole-row computation (ties to the lowest id, as `max(dim)`).
            Pruning to the tokens that can still win (g < 16.64 by the clamp) was measured and
            dropped: on real SmolLM2 logits at temperature 0.8, 7-11% of the vocabulary stays
            within reach, and finding them (row max, compare, nonzero) cost as much as the
            chunked hash of every token on 2 threads.
"""

from __future__ import annotations

import torch

from ops.sampling_hash import (
    finish_words_,
    neg_gumbel_,
    neg_gumbel_from_hash,
    row_prefix_hash,
    token_words,
)

CHUNK_COLUMNS = 8192  # CPU: [64, 8192] int32 = 2 MiB per buffer


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
    """argmax(rows + g) [R], g the hash noise of per-row `prefix` [R] and every token id.

    On CPU in column chunks of CHUNK_COLUMNS, so the ~25 passes of hash, noise and keys run on
    cache-resident buffers (measured 1.5-2x faster than whole rows at [64, 49152]); a later
    chunk wins only with a strictly larger key, so ties still go to the lowest id.
    """
    num_rows, vocab = rows.shape
    words = token_words(torch.arange(vocab, device=rows.device))  # [V]
    is_cpu = rows.device.type == "cpu"
    width = min(vocab, CHUNK_COLUMNS) if is_cpu else vocab
    h = torch.empty(num_rows, width, dtype=torch.int32, device=rows.device)
    scratch, keys = torch.empty_like(h), torch.empty(h.shape, device=rows.device)
    best = best_ids = None
    ranks = torch.arange(width, 0, -1, dtype=torch.float32) if is_cpu else None  # for _max_
    for start in range(0, vocab, width):
        end = min(start + width, vocab)
        if end - start < width:  # the last, narrower chunk
            h, scratch, keys = (
                h[:, : end - start],
                scratch[:, : end - start],
                keys[:, : end - start],
            )
            h, scratch, keys = h.contiguous(), scratch.contiguous(), keys.contiguous()
        torch.bitwise_xor(prefix[:, None], words[start:end], out=h)
        noise = neg_gumbel_from_hash(finish_words_(h, scratch), out=keys)
        torch.sub(rows[:, start:end], noise, out=keys)  # [R, W] keys = scaled + g
        values, ids = _max_(keys, ranks[-keys.shape[-1] :]) if is_cpu else keys.max(dim=-1)
        if best is None:
            best, best_ids = values, ids
        else:
            is_better = values > best
            best = torch.where(is_better, values, best)
            best_ids = torch.where(is_better, ids + start, best_ids)
    return best_ids


def _max_(keys: torch.Tensor, ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`keys.max(dim=-1)` for CPU float32 keys [R, W] (finite or -inf), clobbering `keys`: the
    same values and tie rule (the first index of the maximum), ~4x cheaper at [64, 8192] because
    every pass is a vectorised in-place op (max(dim)'s index reduction is not). `ranks` is
    W, W - 1, ..., 1 (float32, exact below 2^24).
    """
    width = keys.shape[-1]
    best = keys.amax(dim=-1, keepdim=True)  # [R, 1]
    # 1.0 exactly where keys == best (finite a - b == 0 iff a == b); an all -inf row is NaN: 0.0
    is_best = keys.sub_(best).ge_(0.0)
    last = is_best.mul_(ranks).amax(dim=-1)  # W - first index of the maximum; 0 if none
    return best.squeeze(1), (width - last.long()) % width
