"""Temperature-only rows: one draw from softmax(scaled) over the whole vocabulary.

These rows pay for the full vocabulary every step, so each kind has its own cheaper exact form:
  unseeded  on CPU, inverse CDF: softmax, an in-place cumsum and one uniform per row from
            `generator` (2 passes instead of Gumbel-max's [R, V] uniforms + two logs: the CPU
            uniform generator alone cost ~11 ms at [64, 49152]). Exact to float32 resolution
            (cumsum accumulates in double on CPU; a token's probability is off by at most ~2^-24
            of the row mass), reproducible under a fixed generator state. On devices, Gumbel-max.
  seeded    Gumbel-max with the contract's hash noise, argmax(scaled + g), every token hashed
            (int32 words, in place); on CPU in cache-sized column chunks, and the two logs of
            g = -log(-log(u)) taken only where a key can still win: key <= x - log(1 - u),
            which the float bits of 1 - u bound from above in three cheap passes, so a row
            keeps one or two 64-column blocks for exact keys. Bit for bit the noise, keys and
            token of the whole-row computation (ties to the lowest id, as `max(dim)`). Pruning
            by the noise clamp alone (g < 16.64) was measured and dropped: 7-11% of the
            vocabulary stays within reach on real logits.
"""

from __future__ import annotations

import math

import torch

from ops.sampling.seeded_hash import (
    finish_rotated_,
    finish_words_,
    neg_gumbel_,
    neg_gumbel_from_hash,
    rotated_token_words,
    rotl13,
    row_prefix_hash,
    token_words,
    uniform_from_hash,
)

CHUNK_COLUMNS = 8192  # CPU: [64, 8192] int32 = 2 MiB per buffer
BLOCK = 64  # columns per block of the candidate search (`block_bounds`, `best_in_blocks`)
_LN2 = math.log(2.0)
_BIAS_LN2 = 127 * _LN2  # the float exponent bias, in nats
_ONE = torch.tensor(1.0)  # 0-dim: `1 - u` as one pass with out=


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
    """argmax(rows + g) [R], g the hash noise of per-row `prefix` [R] and every token id; ties
    go to the lowest id.

    Devices: one whole-row pass (hash, noise, keys, max). CPU: the hash and the uniforms run in
    column chunks of CHUNK_COLUMNS on cache-resident buffers (measured 1.5-2x faster than whole
    rows at [64, 49152]), and the two logs of the noise, g = -log(-log(u)), only where a key
    can still be the row's largest (`block_bounds`, `best_in_blocks`).
    """
    num_rows, vocab = rows.shape
    if rows.device.type != "cpu":
        words = token_words(torch.arange(vocab, device=rows.device))  # [V]
        keys = torch.sub(rows, seeded_noise(prefix[:, None] ^ words))  # [R, V] scaled + g
        return keys.max(dim=-1).indices
    words = rotated_token_words(vocab, rows.device)  # [V]
    rotated = rotl13(prefix)[:, None]  # [R, 1]: rotl13(prefix ^ word) = rotl13(p) ^ rotl13(w)
    # chunks start on block boundaries: a whole number of blocks wide
    width = min(vocab, max(BLOCK, CHUNK_COLUMNS // BLOCK * BLOCK))
    h = torch.empty(num_rows, width, dtype=torch.int32)
    scratch = torch.empty_like(h)
    bound = torch.empty(num_rows, -(-width // BLOCK) * BLOCK)
    u = torch.empty(num_rows, vocab)  # every token's (clamped) uniform
    blocks = torch.empty(num_rows, -(-vocab // BLOCK))  # per block, the largest key bound
    for start in range(0, vocab, width):
        end = min(start + width, vocab)
        if end - start < width:  # the last, narrower chunk
            h, scratch = h[:, : end - start].contiguous(), scratch[:, : end - start].contiguous()
            bound = bound[:, : -(-(end - start) // BLOCK) * BLOCK].contiguous()
        torch.bitwise_xor(rotated, words[start:end], out=h)
        chunk_u = u[:, start:end]
        uniform_from_hash(finish_rotated_(h, scratch), out=chunk_u)
        block_bounds(rows[:, start:end], chunk_u, h, bound, blocks[:, start // BLOCK :])
    return best_in_blocks(rows, u, blocks)


def seeded_noise(h: torch.Tensor) -> torch.Tensor:
    """-g (float32, a new tensor) from h = prefix ^ token word (int32, clobbered)."""
    return neg_gumbel_from_hash(finish_words_(h))


def block_bounds(x, u, scratch: torch.Tensor, bound: torch.Tensor, out: torch.Tensor) -> None:
    """Upper bounds (up to one shared constant) of the keys x - log(-log(u)), per BLOCK columns.

    x, u [R, W]; scratch: int32 [R, W] (clobbered); bound: float32 scratch [R, W rounded up to
    BLOCK]; writes the first ceil(W / BLOCK) columns of `out` [R, >= W / BLOCK]. -log(u) >=
    1 - u, so a key is <= x - log(1 - u); with b the bits of 1 - u (in [2^-24, 1): a normal
    float) read as an int32, log2(1 - u) >= b / 2^23 - 127 (the mantissa's chord lies under
    log2), so key <= ub = x - ln2 (b / 2^23 - 127). Two logs per token become three cheap
    passes; the bound is within ~0.06 of the key where it matters (u near 1: large noise).
    """
    num_rows, width = x.shape
    torch.sub(_ONE, u, out=scratch.view(torch.float32))  # 1 - u, into scratch's memory
    ub = bound[:, :width]
    ub.copy_(scratch)  # float(b): rounding <= 2^-17 in log2 units
    torch.add(x, ub, alpha=-_LN2 * 2.0**-23, out=ub)  # ub - 127 ln2 (best_in_blocks adds it)
    bound[:, width:] = -torch.inf
    num_blocks = bound.shape[1] // BLOCK
    torch.amax(bound.view(num_rows, num_blocks, BLOCK), dim=-1, out=out[:, :num_blocks])


def best_in_blocks(x: torch.Tensor, u: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The first column of each row's largest key x - log(-log(u)) [R], given `block_bounds`.

    The exact keys of each row's block with the largest bound give a floor: the row's largest
    key is at least their maximum, so only blocks whose bound reaches the floor (minus a
    rounding margin) can hold it, one or two per row. Every column of those blocks gets its
    exact key by the very ops of the dense path (log, neg, log, then x - that), so the id and
    the tie rule (lowest id) are those of `(x - log(-log(u))).max(dim=-1)`; a row with no
    finite key gives 0.
    """
    num_rows, vocab = x.shape
    span = torch.arange(BLOCK)
    first_cols = (blocks.argmax(dim=-1)[:, None] * BLOCK + span).clamp_(max=vocab - 1)
    floor = _exact_keys(x, u, torch.arange(num_rows)[:, None], first_cols).amax(dim=-1)  # [R]
    # margin: float32 rounding of ub and of the keys (a few ulps of |x| <= |floor| + 100) and
    # of the logs, with a 10x safety factor; rows with no finite key get no candidate
    reach = floor - (_BIAS_LN2 + 1e-5 * (floor.abs() + 100.0) + 1e-4)  # bounds lack 127 ln2
    reach = torch.where(torch.isfinite(floor), reach, torch.inf)
    row_ids, block_ids = (blocks >= reach[:, None]).nonzero(as_tuple=True)  # [K]
    cols = (block_ids[:, None] * BLOCK + span).clamp_(max=vocab - 1)  # [K, BLOCK]
    keys = _exact_keys(x, u, row_ids[:, None], cols)  # the last block's padding repeats a column
    values = torch.full((num_rows,), -torch.inf).scatter_reduce_(
        0, row_ids, keys.amax(dim=-1), "amax"
    )
    cols = cols.masked_fill_(keys != values[row_ids, None], vocab).amin(dim=-1)  # [K]
    first = torch.full((num_rows,), vocab).scatter_reduce_(0, row_ids, cols, "amin")
    return first.masked_fill_(first == vocab, 0)


def _exact_keys(x, u, rows, cols) -> torch.Tensor:
    """x + g at (rows, cols), g from the gathered uniforms by the dense path's ops."""
    return x[rows, cols] - neg_gumbel_(u[rows, cols])
