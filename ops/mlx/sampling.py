"""The MLX sampler: the contract of ops.sampling.sampler.sample, computed in one MLX island.

Same signature, same SamplingBatch, same order of edits, same Gumbel-max formula
(argmax(scaled + g) over the survivors). The seeded hash runs on native uint32 words, so on
identical fp32 logits greedy and seeded rows pick the same tokens as the torch path. Unseeded
rows draw MLX noise from a key taken from the torch `generator`, so a fixed torch seed and
schedule still reproduce outputs (though not the torch path's draws).

The whole step (edits, penalties, temperature, filtering, noise, logprobs) is one
`mlx_call_multi`: one fence, one eval, one export.
"""

from __future__ import annotations

import torch

from bridge import mlx_call_multi
from ops.sampling.batch import SamplingBatch
from ops.sampling.sampler import SampleOutput, check_shapes
from ops.sampling.seeded_hash import U_MAX, U_MIN

_FLOAT_MAX = float(torch.finfo(torch.float32).max)
_M32 = 0xFFFFFFFF


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    positions: torch.Tensor,
    generator: torch.Generator | None = None,
) -> SampleOutput:
    """MLX variant of `ops.sampling.sampler.sample` (see there for the contract)."""
    check_shapes(logits, batch, positions)
    groups = {"greedy": batch.greedy, "plain": batch.plain, "filtering": batch.filtering}
    needs_random = any(
        g is not None and not g.is_all_seeded for g in (batch.plain, batch.filtering)
    )
    key_seed = None
    if needs_random:  # one draw from the torch generator keys all of this step's MLX noise
        device = generator.device if generator is not None else "cpu"
        key_seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=device))
    tensors = {"positions": positions.to(torch.int64), "temperatures": batch.temperatures}
    for name, group in groups.items():
        if group is not None:
            tensors.update(
                {
                    f"{name}_rows": group.rows,
                    f"{name}_seeds": group.seeds,
                    f"{name}_seeded": group.is_seeded,
                }
            )
    if batch.filter_params is not None:
        fp = batch.filter_params
        tensors.update(top_ks=fp.top_ks, top_ps=fp.top_ps, min_ps=fp.min_ps)
    if batch.penalties is not None:
        pen = batch.penalties
        tensors.update(
            repetition=pen.repetition,
            seen=pen.seen,
            presence=pen.presence,
            frequency=pen.frequency,
            counts=pen.counts,
        )
    tensors["edits"] = batch.logit_edits
    config = {
        "groups": tuple(name for name, g in groups.items() if g is not None),
        "width": batch.filter_params.width if batch.filter_params is not None else 0,
        "needs_mass": batch.filter_params is not None and batch.filter_params.needs_mass,
        "key_seed": key_seed,
        "needs_logprobs": batch.needs_logprobs,
        "num_top": batch.num_top_logprobs,
    }
    present = {k: v for k, v in tensors.items() if v is not None}
    outputs = mlx_call_multi(_sample_island, logits, config=config, **present)
    token_ids = outputs[0]
    if not batch.needs_logprobs:
        return SampleOutput(token_ids, None, None)
    top = (outputs[2], outputs[3]) if batch.num_top_logprobs else None
    return SampleOutput(token_ids, outputs[1], top)


def _sample_island(logits, config, **t):
    import mlx.core as mx

    x = _process(mx, logits, t)  # [B, V] fp32
    num_rows = x.shape[0]
    key = mx.random.key(config["key_seed"]) if config["key_seed"] is not None else None
    token_ids = mx.zeros((num_rows,), dtype=mx.int64)
    for name in config["groups"]:
        rows = t.get(f"{name}_rows")
        xr = x if rows is None else mx.take(x, rows, axis=0)  # [R, V]
        if name == "greedy":
            chosen = mx.argmax(xr, axis=-1)
        else:
            seeds, seeded = t.get(f"{name}_seeds"), t.get(f"{name}_seeded")
            positions = t["positions"] if rows is None else mx.take(t["positions"], rows)
            if key is not None:
                key, sub = mx.random.split(key)
            else:
                sub = None
            if name == "plain":
                ids = mx.arange(xr.shape[1], dtype=mx.int64)
                noise = _neg_noise(mx, seeds, seeded, positions, ids, xr.shape, sub)
                chosen = mx.argmax(xr - noise, axis=-1)
            else:
                chosen = _filtered(
                    mx, xr, t, config["width"], config["needs_mass"], seeds, seeded, positions, sub
                )
        chosen = chosen.astype(mx.int64)
        if rows is None:
            token_ids = chosen
        else:
            token_ids[rows] = chosen
    if not config["needs_logprobs"]:
        return (token_ids,)
    lse = _safe_logsumexp(mx, x)  # [B, 1]
    chosen_lp = mx.take_along_axis(x, token_ids[:, None], axis=-1)[:, 0] - lse[:, 0]
    if not config["num_top"]:
        return (token_ids, chosen_lp)
    values, ids = _top(mx, x, config["num_top"])
    return (token_ids, chosen_lp, ids.astype(mx.int64), values - lse)


def _process(mx, logits, t):
    """Edits -> penalties -> / temperature -> NaN to -inf, +inf to the largest float."""
    x = logits.astype(mx.float32)
    if "edits" in t:
        x = x + t["edits"]
    if "seen" in t:
        r = t["repetition"][:, None]
        x = mx.where(t["seen"], mx.where(x > 0, x / r, x * r), x)
    if "counts" in t:
        counts = t["counts"]
        x = x - t["frequency"][:, None] * counts - t["presence"][:, None] * (counts > 0)
    if "temperatures" in t:
        x = x / t["temperatures"][:, None]
    x = mx.where(mx.isnan(x), -mx.inf, x)
    return mx.minimum(x, _FLOAT_MAX)


def _top(mx, x, width: int):
    """The `width` largest values of each row, descending, with their ids."""
    if width >= x.shape[-1]:
        ids = mx.argsort(-x, axis=-1)
    else:
        ids = mx.argpartition(-x, kth=width - 1, axis=-1)[:, :width]
        order = mx.argsort(-mx.take_along_axis(x, ids, axis=-1), axis=-1)
        ids = mx.take_along_axis(ids, order, axis=-1)
    return mx.take_along_axis(x, ids, axis=-1), ids


def _filtered(mx, xr, t, width, needs_mass, seeds, seeded, positions, key):
    """The torch path's formula: relative weights w = exp(v - v0), min-p as w < min_p, top-p
    against the row mass Z = sum exp(x - v0); keys = v - (-g) over the survivors."""
    values, ids = _top(mx, xr, width)  # [F, W], descending
    best = values[:, :1]
    weights = mx.exp(values - best)
    ranks = mx.arange(width)[None, :]
    drop = ranks >= t["top_ks"][:, None]
    drop = drop | (weights < t["min_ps"][:, None])
    if needs_mass:
        mass = mx.sum(mx.exp(xr - best), axis=-1, keepdims=True)
        drop = drop | ((mx.cumsum(weights, axis=-1) - weights) > t["top_ps"][:, None] * mass)
    keys = mx.where(drop, -mx.inf, values)
    keys = keys - _neg_noise(mx, seeds, seeded, positions, ids.astype(mx.int64), keys.shape, key)
    pick = mx.argmax(keys, axis=-1)
    return mx.take_along_axis(ids, pick[:, None], axis=-1)[:, 0]


def _safe_logsumexp(mx, x):
    lse = mx.logsumexp(x, axis=-1, keepdims=True)
    return mx.where(lse == -mx.inf, 0.0, lse)


def _neg_noise(mx, seeds, seeded, positions, token_ids, shape, key):
    """-g = log(-log(u)): hashed (clamped, the seeded contract) or from `key` (u = 0 loses)."""
    hashed = None
    if seeds is not None:
        h = murmur_hash32_mx(mx, seeds, positions, token_ids)
        u = h.astype(mx.float32) / mx.array(float(_M32), dtype=mx.float32)
        hashed = mx.log(-mx.log(mx.clip(u, U_MIN, U_MAX)))
        if seeded is None:  # every row of the group is seeded
            return hashed
    random = mx.log(-mx.log(mx.random.uniform(shape=shape, key=key)))
    if hashed is None:
        return random
    return mx.where(seeded[:, None], hashed, random)


def murmur_hash32_mx(mx, seeds, positions, token_ids):
    """MurmurHash3(seed [R] int64 bits, position [R], token [W] or [R, W]) -> [R, W] uint32."""

    def word(v):
        return (v & _M32).astype(mx.uint32)

    def rotl(h, r):
        return (h << r) | (h >> (32 - r))

    def mix(h, k):
        k = rotl(k * 0xCC9E2D51, 15) * 0x1B873593
        return rotl(h ^ k, 13) * 5 + 0xE6546B64

    h = mx.zeros(seeds.shape, dtype=mx.uint32)
    h = mix(h, word(seeds))
    h = mix(h, word(seeds >> 32))
    h = mix(h, word(positions))
    h = mix(h[:, None], word(token_ids))  # [R, W]
    h = h ^ 16
    h = (h ^ (h >> 16)) * 0x85EBCA6B
    h = (h ^ (h >> 13)) * 0xC2B2AE35
    return h ^ (h >> 16)
