"""The seeded-noise hash against a pure-Python transcription of ../shared/reference/seeded-sampling.md."""

import numpy as np
import pytest
import torch

from ops.sampling.sampler import murmur_hash32
from ops.sampling.seeded_hash import U_MAX, U_MIN, seeded_gumbel, to_signed64

M = 0xFFFFFFFF
SEEDS = [0, 1, 42, 2**31, 2**63 + 12345]
POSITIONS = [0, 7, 1023, 2**31 - 1]
TOKENS = [0, 1, 2, 17, 1000, 49151, 151935, 201087, 2**31 - 1]


def _rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & M


def _mix(h, k):
    k = k * 0xCC9E2D51 & M
    k = _rotl(k, 15)
    k = k * 0x1B873593 & M
    h ^= k
    h = _rotl(h, 13)
    return (h * 5 + 0xE6546B64) & M


def reference_hash(seed: int, pos: int, tok: int) -> int:
    h = 0
    for word in (seed & M, (seed >> 32) & M, pos & M, tok & M):
        h = _mix(h, word)
    h ^= 16
    h ^= h >> 16
    h = h * 0x85EBCA6B & M
    h ^= h >> 13
    h = h * 0xC2B2AE35 & M
    h ^= h >> 16
    return h


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("pos", POSITIONS)
def test_torch_hash_matches_reference(seed, pos):
    got = murmur_hash32(seed, pos, TOKENS)
    assert got.dtype == torch.int64
    assert got.tolist() == [reference_hash(seed, pos, t) for t in TOKENS]


def test_hash_rows_with_tensor_seeds_and_positions():
    seeds = torch.tensor([to_signed64(s) for s in SEEDS])
    positions = torch.tensor(POSITIONS + [5])
    got = murmur_hash32(seeds, positions, TOKENS)  # [5, 9]
    for r, (s, p) in enumerate(zip(SEEDS, POSITIONS + [5])):
        assert got[r].tolist() == [reference_hash(s, p, t) for t in TOKENS]


def test_mlx_hash_matches_reference():
    mx = pytest.importorskip("mlx.core")
    from ops.mlx.sampling import murmur_hash32_mx

    for seed in SEEDS:
        for pos in POSITIONS:
            got = murmur_hash32_mx(
                mx,
                mx.array([to_signed64(seed)], dtype=mx.int64),
                mx.array([pos], dtype=mx.int64),
                mx.array(TOKENS, dtype=mx.int64),
            )
            assert [int(v) for v in got[0].tolist()] == [
                reference_hash(seed, pos, t) for t in TOKENS
            ]


def reference_gumbel(seed: int, pos: int, tokens) -> np.ndarray:
    """float32 noise per the reference: u = h / 0xFFFFFFFF, clamp, g = -log(-log(u))."""
    h = np.array([reference_hash(seed, pos, t) for t in tokens], dtype=np.float32)
    u = np.clip(h / np.float32(M), np.float32(2.0**-32), np.float32(1 - 2.0**-24))
    return -np.log(-np.log(u))


def test_seeded_noise_is_float32_reference():
    tokens = list(range(4096))
    for seed, pos in [(0, 0), (42, 1023), (2**63 + 12345, 2**31 - 1)]:
        got = seeded_gumbel(
            torch.tensor([to_signed64(seed)]), torch.tensor([pos]), torch.arange(4096)
        )
        assert got.dtype == torch.float32
        np.testing.assert_allclose(
            got[0].numpy(), reference_gumbel(seed, pos, tokens), rtol=2e-6, atol=2e-6
        )


def test_uniform_clamp_keeps_noise_finite():
    # 0xFFFFFFFF / 0xFFFFFFFF rounds to exactly 1.0 in float32, and 0 would give -inf.
    assert np.float32(M) / np.float32(M) == 1.0
    from ops.sampling.seeded_hash import gumbel_from_uniform

    g = gumbel_from_uniform(torch.tensor([0.0, 1.0, U_MIN, U_MAX]))
    assert torch.isfinite(g).all()
    assert g[0] == g[2] and g[1] == g[3]


def test_seed_outside_uint64_is_rejected():
    with pytest.raises(ValueError, match="seed"):
        murmur_hash32(2**64, 0, [1])
