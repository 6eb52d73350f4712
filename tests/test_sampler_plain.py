"""Temperature-only rows (ops/sampling/plain.py): the chunked seeded draw picks the token of the
whole-row argmax (ties included), the int32 noise route is the int64 one bit for bit, and the
inverse-CDF draw follows softmax. Oracles: numpy float32 noise from the pure-Python hash,
brute-force argmax, chi-square against the exact distribution."""

import numpy as np
import pytest
import torch

from ops.sampling.batch import SamplingBatch
from ops.sampling.params import SamplingParams as SP
from ops.sampling.plain import BLOCK, best_in_blocks, block_bounds, inverse_cdf_draw, seeded_draw
from ops.sampling.sampler import sample
from ops.sampling.seeded_hash import (
    U_MAX,
    U_MIN,
    finish_hash,
    finish_rotated_,
    neg_gumbel_from_hash,
    rotated_token_words,
    rotl13,
    row_prefix_hash,
)
from tests.test_sampler_distribution import chi_square_limit
from tests.test_sampler_hash import reference_hash

M = 0xFFFFFFFF
FLOAT_MAX = torch.finfo(torch.float32).max


def reference_neg_gumbel(hashes: np.ndarray) -> torch.Tensor:
    """-g by the contract's int64 route: float32(h) / float32(0xFFFFFFFF), clamp, log(-log u)."""
    u = np.clip(hashes.astype(np.float32) / np.float32(M), np.float32(U_MIN), np.float32(U_MAX))
    return torch.from_numpy(u).log().neg().log()


def test_int32_noise_route_is_the_int64_route_bit_for_bit():
    rng = np.random.default_rng(0)
    # float32 rounding ties and edges of the hi/lo split, then random words
    edges = [0, 1, 127, 128, 255, 256, 2**24 - 1, 2**24, 2**24 + 1, 2**31 - 1, 2**31, M]
    edges += [2**31 + 128, 2**31 + 384, 2**32 - 128, 2**32 - 129, 2**25 + 2, 2**25 + 6]
    hashes = np.concatenate([np.array(edges, dtype=np.uint64), rng.integers(0, 2**32, 200_000)])
    words = torch.from_numpy(hashes.astype(np.uint32).view(np.int32).copy())
    got = neg_gumbel_from_hash(words)
    want = reference_neg_gumbel(hashes)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_hash_of_candidates_matches_reference():
    seeds, positions = torch.tensor([5, 2**40 + 3]), torch.tensor([17, 2**31 - 1])
    tokens = torch.tensor([[0, 9, 49151], [3, 3, 201087]])
    got = finish_hash(row_prefix_hash(seeds, positions), tokens).numpy().view(np.uint32)
    for r in range(2):
        want = [reference_hash(int(seeds[r]), int(positions[r]), int(t)) for t in tokens[r]]
        assert got[r].tolist() == want


def brute_force_seeded(rows: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """First argmax of rows - (-g), -g from the int64 reference route, every token hashed."""
    vocab = rows.shape[-1]
    h = finish_hash(prefix, torch.arange(vocab)).numpy().view(np.uint32).astype(np.uint64)
    return (rows - reference_neg_gumbel(h)).max(dim=-1).indices


def mixed_rows(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Peaked, flat, masked and extreme rows."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_rows, vocab, generator=gen) * 6  # about a fifth are candidates
    rows[0] = rows[0] * 4  # peaked: few candidates
    rows[1] = torch.randn(vocab, generator=gen) * 0.5  # flat: every token a candidate (wide)
    rows[2, ::3] = float("-inf")  # grammar-masked
    rows[3] = float("-inf")  # no finite logit
    rows[4, 7] = FLOAT_MAX  # +inf became the largest float
    rows[5] = rows[5] * 100  # huge spread
    rows[6] = rows[6] * 1e-3 + 1e6  # large magnitude, tiny spread (rounding margin)
    return rows


@pytest.mark.parametrize("vocab, chunk", [(300, 8192), (4099, 8192), (4099, 1000), (49152, 8192)])
def test_chunked_seeded_draw_is_the_whole_row_argmax(vocab, chunk, monkeypatch):
    monkeypatch.setattr("ops.sampling.plain.CHUNK_COLUMNS", chunk)  # 1000: 4 chunks + 99
    rows = mixed_rows(12, vocab, seed=vocab)
    seeds = torch.tensor([3, 2**63 - 1, 0, 42, 7, 8, 9, 10, 11, 12, 13, 2**31])
    prefix = row_prefix_hash(seeds, torch.arange(12) + 1000)
    want = brute_force_seeded(rows, prefix)
    assert torch.equal(seeded_draw(rows, prefix), want)
    assert want[3] == 0 and want[4] == 7


@pytest.mark.parametrize("first, second", [(10, 200), (200, 10)])
@pytest.mark.parametrize("chunk", [8192, 100])  # 100: the tied tokens in different chunks
def test_equal_keys_go_to_the_lowest_id_as_in_the_full_draw(first, second, chunk, monkeypatch):
    monkeypatch.setattr("ops.sampling.plain.CHUNK_COLUMNS", chunk)
    vocab = 256
    prefix = row_prefix_hash(torch.tensor([99]), torch.tensor([5]))
    neg_g = neg_gumbel_from_hash(finish_hash(prefix, torch.arange(vocab)))[0]
    row = torch.full((vocab,), -50.0)
    row[second] = 3.0
    key = row[second] - neg_g[second]
    x = (key + neg_g[first]).reshape(1)  # find x with x - (-g) == key exactly
    while (x - neg_g[first]) != key:
        x = torch.nextafter(x, torch.tensor([float("inf") if x - neg_g[first] < key else 0.0]))
    row[first] = x[0]
    rows = row[None]
    assert torch.equal(brute_force_seeded(rows, prefix), torch.tensor([min(first, second)]))
    assert seeded_draw(rows, prefix).item() == min(first, second)


def test_seeded_plain_rows_follow_softmax_over_chunks(monkeypatch):
    """12 live tokens spread over 4096 (CHUNK_COLUMNS 1000: every chunk boundary crossed); the
    draws over positions follow softmax(logits / T) of the live tokens."""
    monkeypatch.setattr("ops.sampling.plain.CHUNK_COLUMNS", 1000)
    live = torch.tensor([1.3, -0.3, 2.0, 0.2, 1.0, -2.0, 0.7, 1.6, 0.0, -0.8, 0.5, -1.2])
    vocab, num_draws, temperature = 4096, 20000, 0.9
    ids = torch.arange(12) * 300 + 11  # spread over the vocabulary
    row = torch.full((vocab,), -40.0)
    row[ids] = live
    params = [SP(temperature=temperature, seed=77)] * num_draws
    batch = SamplingBatch.build(params, [[]] * num_draws, [[]] * num_draws, vocab, "cpu")
    tokens = sample(row.repeat(num_draws, 1), batch, torch.arange(num_draws)).token_ids
    assert torch.isin(tokens, ids).all()
    observed = np.bincount(np.searchsorted(ids.numpy(), tokens.numpy()), minlength=12)
    expected = torch.softmax(live.double() / temperature, 0).numpy() * num_draws
    stat = float(((observed - expected) ** 2 / expected).sum())
    assert stat < chi_square_limit(11), (stat, observed, expected.round(1))


def test_inverse_cdf_draw_follows_softmax_and_never_picks_masked_tokens():
    vocab, num_draws = 40, 20000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    logits[::4] = float("-inf")
    logits[-1] = 1.5  # the last id live: the target never passes the row total
    tokens = inverse_cdf_draw(logits.repeat(num_draws, 1), torch.Generator().manual_seed(8))
    observed = np.bincount(tokens.numpy(), minlength=vocab)
    expected = torch.softmax(logits.double(), 0).numpy() * num_draws
    assert observed[expected == 0].sum() == 0
    live = expected > 0
    stat = float(((observed[live] - expected[live]) ** 2 / expected[live]).sum())
    assert stat < chi_square_limit(int(live.sum()) - 1), stat


def test_mixed_seeded_and_unseeded_plain_rows():
    """Seeded rows of a mixed group pick the reference token; unseeded ones follow softmax."""
    vocab, n = 30, 4000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(4))
    params = [SP(temperature=0.8, seed=5) if i % 4 == 0 else SP(temperature=0.8) for i in range(n)]
    batch = SamplingBatch.build(params, [[]] * n, [[]] * n, vocab, "cpu")
    positions = torch.arange(n) + 3
    tokens = sample(logits.repeat(n, 1), batch, positions, torch.Generator().manual_seed(1))
    tokens = tokens.token_ids
    seeded = torch.arange(0, n, 4)
    prefix = row_prefix_hash(torch.full((len(seeded),), 5), positions[seeded])
    scaled = (logits / 0.8).repeat(len(seeded), 1)
    assert torch.equal(tokens[seeded], brute_force_seeded(scaled, prefix))
    others = tokens[torch.arange(n) % 4 != 0].numpy()
    observed = np.bincount(others, minlength=vocab)
    expected = torch.softmax(logits.double() / 0.8, 0).numpy() * len(others)
    stat = float(((observed - expected) ** 2 / expected).sum())
    assert stat < chi_square_limit(vocab - 1), stat


@pytest.mark.parametrize("width", [1, 7, 64, 8192])
def test_block_search_is_the_dense_max_with_ties_and_masked_rows(width):
    """Logs only near the top: the same first ids as the dense keys' max(dim), for tied
    keys, masked and all -inf rows, huge and tiny magnitudes."""
    gen = torch.Generator().manual_seed(width)
    u = torch.rand(10, width, generator=gen).clamp_(U_MIN, U_MAX)
    u[:, ::5] = U_MAX  # the largest noise, often, so keys tie across columns
    x = torch.randint(-3, 3, (10, width), generator=gen).float()  # many equal logits
    x[1] = float("-inf")  # no finite key
    x[2, ::2] = float("-inf")
    x[3, -1] = FLOAT_MAX
    x[4] = torch.randn(width, generator=gen) * 1e6
    x[5] = torch.randn(width, generator=gen) * 1e-3 + 1e6  # ulp(1e6) = 1/16: ties by rounding
    x[6] = -1e30
    want = (x - u.log().neg().log()).max(dim=-1).indices
    num_blocks = -(-width // BLOCK)
    blocks = torch.empty(10, num_blocks)
    scratch = torch.empty(10, width, dtype=torch.int32)
    block_bounds(x, u, scratch, torch.empty(10, num_blocks * BLOCK), blocks)
    assert torch.equal(best_in_blocks(x, u, blocks), want)


def test_rotated_words_route_is_the_plain_hash():
    """rotl13(prefix) ^ rotl13(word) then `finish_rotated_` == `finish_hash` (rotation is a bit
    permutation, so it distributes over xor)."""
    prefix = row_prefix_hash(torch.tensor([0, 1, 2**63 - 1]), torch.tensor([0, 7, 2**31 - 1]))
    h = rotl13(prefix)[:, None] ^ rotated_token_words(5000, torch.device("cpu"))
    assert torch.equal(finish_rotated_(h), finish_hash(prefix, torch.arange(5000)))


def test_hash_constants_as_ints_and_as_cpu_tensors_agree(monkeypatch):
    """Devices hash with Python-int constants, CPU with 0-dim int32 tensors: same words."""
    import ops.sampling.seeded_hash as sampling_hash

    words = torch.randint(-(2**31), 2**31 - 1, (5, 300), dtype=torch.int32)
    with_tensors = sampling_hash.finish_words_(words.clone())
    monkeypatch.setattr(sampling_hash, "_K", sampling_hash._K_INTS)
    assert torch.equal(sampling_hash.finish_words_(words.clone()), with_tensors)
