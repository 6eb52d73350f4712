"""Seeded Gumbel noise: MurmurHash3(seed, position, token id), per ../shared/reference/seeded-sampling.md.

A seeded row must pick the same token whatever its batchmates, the RNG state or the bounded /
full-vocabulary path, so its noise is a pure function of (seed, position, token id). The hash runs
in wrapping int32 arithmetic (3-4x cheaper than int64 on CPU) and the seed/position words are
mixed once per row, so only the token word and the finaliser touch the [R, W] tensor.
"""

from __future__ import annotations

import functools

import torch

_M32 = 0xFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_N = 0xE6546B64
_F1 = 0x85EBCA6B
_F2 = 0xC2B2AE35
# Clamp of the uniform draw: 0xFFFFFFFF rounds to 2^32 in float32, and u == 1 gives +inf noise.
U_MIN = 2.0**-32
U_MAX = 1.0 - 2.0**-24


def _i32(value: int) -> int:
    """An unsigned 32-bit constant as the signed int32 with the same bits."""
    return value - (1 << 32) if value >= (1 << 31) else value


def _shr(h: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int32 words (torch's >> is arithmetic)."""
    return (h >> n) & ((1 << (32 - n)) - 1)


def _shr_into(h: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """`_shr` written into `out` (no [R, W] allocation)."""
    return torch.bitwise_right_shift(h, n, out=out).bitwise_and_((1 << (32 - n)) - 1)


def _rotl(h: torch.Tensor, r: int) -> torch.Tensor:
    return (h << r) | _shr(h, 32 - r)


def _scramble(k: torch.Tensor) -> torch.Tensor:
    k = k * _i32(_C1)
    k = _rotl(k, 15)
    return k * _i32(_C2)


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    h = h ^ _scramble(k)
    h = _rotl(h, 13)
    return h * 5 + _i32(_N)


def _low_word(x: torch.Tensor) -> torch.Tensor:
    """Low 32 bits of int64 values as int32 (bit pattern kept)."""
    x = x & _M32
    return torch.where(x >= (1 << 31), x - (1 << 32), x).to(torch.int32)


def row_prefix_hash(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Hash state after the seed (two words) and position words: [R] int32.

    `seeds` are uint64 stored in int64 (two's complement bit pattern); `positions` int64.
    """
    h = torch.zeros_like(seeds, dtype=torch.int32)
    h = _mix(h, _low_word(seeds))
    h = _mix(h, _low_word(seeds >> 32))  # arithmetic shift; _low_word keeps only the high word
    return _mix(h, _low_word(positions))


def token_words(token_ids: torch.Tensor) -> torch.Tensor:
    """The token word as mixed into the hash (k1 = rotl(tok * c1, 15) * c2), int32, same shape:
    independent of seed and position, so a vocabulary's table can be gathered per candidate."""
    return _scramble(_low_word(token_ids))


def finish_hash(
    prefix: torch.Tensor, token_ids: torch.Tensor, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """Mix the token word into per-row prefixes and finalise: prefix [R], token_ids [R, W] or [W].

    `scratch` (int32 [R, W], clobbered) saves one allocation (see finish_words_).
    """
    return finish_words_(prefix[:, None] ^ token_words(token_ids), scratch)  # [R, W]


def finish_words_(h: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The hash from h = prefix ^ token word (int32, any shape), in place.

    Every step runs in place on `h` plus `scratch` (int32, h's shape, clobbered), since
    allocating [R, W] temporaries cost as much as the arithmetic (measured ~3x slower).
    """
    t = torch.empty_like(h) if scratch is None else scratch
    k = _K if h.device.type == "cpu" else _K_INTS
    # rotl 13: the low bits first (a logical shift is an arithmetic one masked to 13 bits)
    low_bits = torch.bitwise_right_shift(h, k[19], out=t).bitwise_and_(k["m13"])
    h.bitwise_left_shift_(k[13]).bitwise_or_(low_bits)
    return finish_rotated_(h, t)


def finish_rotated_(h: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The hash from h = rotl13(prefix ^ token word), in place (see `finish_words_`).

    The hot loop of seeded full-vocabulary rows. A rotation is a bit permutation, so
    rotl13(prefix ^ word) == rotl13(prefix) ^ rotl13(word): callers with a per-vocabulary table
    of rotated words (`rotated_token_words`) skip the four rotation passes per token. On CPU
    the constants are 0-dim int32 tensors (`_K`): a Python int costs each op a scalar-to-int32
    conversion (~18 extra ops, ~20% of the hash).
    """
    t = torch.empty_like(h) if scratch is None else scratch
    k = _K if h.device.type == "cpu" else _K_INTS
    torch.add(k["n"], h, alpha=5, out=h).bitwise_xor_(k[16])  # h * 5 + n, one pass; 16 bytes
    h.bitwise_xor_(torch.bitwise_right_shift(h, k[16], out=t).bitwise_and_(k["m16"]))
    h.mul_(k["f1"])
    h.bitwise_xor_(torch.bitwise_right_shift(h, k[13], out=t).bitwise_and_(k["m19"]))
    h.mul_(k["f2"])
    return h.bitwise_xor_(torch.bitwise_right_shift(h, k[16], out=t).bitwise_and_(k["m16"]))


def rotl13(words: torch.Tensor) -> torch.Tensor:
    """Rotate int32 words left by 13 bits (a new tensor)."""
    return (words << 13) | _shr(words, 19)


@functools.lru_cache(maxsize=8)
def rotated_token_words(vocab: int, device: torch.device) -> torch.Tensor:
    """rotl13(token word) of every id below `vocab` [V] int32: the token's share of the hash
    up to the first multiply, the same for every seed and position (cached per vocabulary)."""
    return rotl13(token_words(torch.arange(vocab, device=device)))


_K_INTS = {13: 13, 16: 16, 19: 19, 5: 5, "n": _i32(_N), "f1": _i32(_F1), "f2": _i32(_F2)}
_K_INTS.update({f"m{b}": (1 << b) - 1 for b in (13, 16, 19)})  # low-b-bit masks
# the same constants as immutable 0-dim int32 CPU tensors, for CPU hashing (devices keep ints)
_K = {key: torch.tensor(value, dtype=torch.int32) for key, value in _K_INTS.items()}


def murmur_hash32(seed, position, token_ids) -> torch.Tensor:
    """MurmurHash3 of (seed, position, token id) as unsigned values in an int64 tensor.

    `seed` / `position` are ints or [R] tensors (one per row); `token_ids` is [W] (shared by every
    row) or [R, W]. Returns [R, W] (or [W] for scalar seed and position).
    """
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64)
    scalar = not torch.is_tensor(seed) and not torch.is_tensor(position)
    seeds = _as_seed_tensor(seed, token_ids.device).reshape(-1)
    positions = torch.as_tensor(position, dtype=torch.int64, device=token_ids.device).reshape(-1)
    seeds, positions = torch.broadcast_tensors(seeds, positions)
    h = finish_hash(row_prefix_hash(seeds, positions), token_ids).to(torch.int64) & _M32
    return h[0] if scalar else h


def _as_seed_tensor(seed, device) -> torch.Tensor:
    if torch.is_tensor(seed):
        return seed.to(device=device, dtype=torch.int64)
    values = [seed] if isinstance(seed, int) else list(seed)
    return torch.tensor([to_signed64(int(s)) for s in values], dtype=torch.int64, device=device)


def to_signed64(seed: int) -> int:
    """A uint64 seed as the int64 with the same bits (torch has no usable uint64)."""
    if not 0 <= seed < (1 << 64):
        raise ValueError(f"seed={seed} is out of range; allowed: 0 <= seed < 2**64")
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def neg_gumbel_(u: torch.Tensor) -> torch.Tensor:
    """-g = log(-log(u)) from float32 uniforms, in place; callers compute keys as x - (-g)
    (bitwise equal to x + g, one pass fewer)."""
    return u.log_().neg_().log_()


def gumbel_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise g = -log(-log(u)) from float32 uniforms (consumed), clamped finite."""
    return neg_gumbel_(u.clamp_(U_MIN, U_MAX)).neg_()


def seeded_neg_gumbel(
    seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Negated float32 Gumbel noise -g [R, W] keyed by (seed [R], position [R], token id [W] or
    [R, W]): u = h / 0xFFFFFFFF in float32, clamped to [2^-32, 1 - 2^-24]."""
    return neg_gumbel_from_hash(finish_hash(row_prefix_hash(seeds, positions), token_ids))


def neg_gumbel_from_hash(h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """-g (float32) from hash words `h` (int32 bits of the uint32 hash), written into `out`
    (float32, h's shape) when given.

    Read as uint32, the words convert to float32 with one rounding, bit for bit the int64 route
    float32(h & 0xFFFFFFFF) without an int64 buffer (1 pass instead of 3); the division by
    float32(0xFFFFFFFF) == 2^32 is an exact scaling.
    """
    return neg_gumbel_(uniform_from_hash(h, out))


def uniform_from_hash(h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """u (float32, clamped to [U_MIN, U_MAX]) from hash words; see `neg_gumbel_from_hash`."""
    u = torch.empty(h.shape, device=h.device) if out is None else out
    u.copy_(h.view(torch.uint32)).mul_(2.0**-32)
    return u.clamp_(U_MIN, U_MAX)


def seeded_gumbel(
    seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Float32 Gumbel noise g [R, W] of the seeded contract (see seeded_neg_gumbel)."""
    return seeded_neg_gumbel(seeds, positions, token_ids).neg_()
