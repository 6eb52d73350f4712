"""Sampled frequencies match the exact filtered distribution (chi-square, numpy only).

Each case draws N tokens in one call (N identical rows), for unseeded rows (generator noise) and
seeded rows (hash noise over N positions), on the torch and the MLX sampler.
"""

import math

import numpy as np
import pytest
import torch

from ops.sampling.batch import SamplingBatch
from ops.sampling.params import SamplingParams as SP
from ops.sampling.sampler import sample as torch_sample

LOGITS = [1.3, -0.3, 2.0, 0.2, 1.0, -2.0, 0.7, 1.6, 0.0, -0.8, 0.5, -1.2]  # ids not sorted
NUM_DRAWS = 20000


def _mlx_sample():
    pytest.importorskip("mlx.core")
    from ops.mlx.sampling import sample

    return sample


def reference_distribution(p: SP) -> np.ndarray:
    """softmax(logits / T), keep rank < top_k, cum-before <= top_p, p >= p_max * min_p; renormalise."""
    z = np.array(LOGITS, dtype=np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), dtype=bool)
    cum = 0.0
    for rank, tok in enumerate(order):
        before = cum
        cum += probs[tok]
        assert abs(before - p.top_p) > 1e-3 or p.top_p == 1.0, "top_p too close to a boundary"
        if (
            (p.top_k == -1 or rank < p.top_k)
            and before <= p.top_p
            and probs[tok] >= probs[order[0]] * p.min_p
        ):
            keep[tok] = True
    weights = np.where(keep, probs, 0.0)
    return weights / weights.sum()


def chi_square_limit(dof: int, z: float = 4.5) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof) at a normal z-score (p ~ 3e-6)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


CASES = [
    SP(temperature=0.7),
    SP(temperature=1.0, top_k=4),
    SP(temperature=1.2, top_p=0.8),
    SP(temperature=0.9, min_p=0.15),
    SP(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05),
    SP(temperature=1.0, top_k=2000, top_p=0.7),  # top_k > 1024: the full-vocabulary path
]


@pytest.mark.parametrize("impl", ["torch", "mlx"])
@pytest.mark.parametrize("seeded", [False, True], ids=["generator", "seeded"])
@pytest.mark.parametrize(
    "p", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"
)
def test_draws_follow_filtered_distribution(impl, seeded, p):
    sample = torch_sample if impl == "torch" else _mlx_sample()
    if seeded:
        p = SP(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=2024)
    vocab = len(LOGITS)
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(NUM_DRAWS, 1)
    batch = SamplingBatch.build([p] * NUM_DRAWS, [[]] * NUM_DRAWS, [[]] * NUM_DRAWS, vocab, "cpu")
    positions = torch.arange(NUM_DRAWS) + 17
    tokens = sample(logits, batch, positions, torch.Generator().manual_seed(5)).token_ids
    observed = np.bincount(tokens.numpy(), minlength=vocab)
    expected = reference_distribution(p) * NUM_DRAWS
    assert observed[expected == 0].sum() == 0, "a filtered-out token was sampled"
    support = expected > 0
    stat = float((((observed - expected) ** 2)[support] / expected[support]).sum())
    dof = int(support.sum()) - 1
    assert dof >= 1
    assert stat < chi_square_limit(dof), (stat, observed, expected.round(1))


def test_chi_square_check_rejects_a_wrong_distribution():
    """The statistic really discriminates: temperature 0.7 draws fail against the T=1 law."""
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(NUM_DRAWS, 1)
    batch = SamplingBatch.build(
        [SP(temperature=0.7)] * NUM_DRAWS, [[]] * NUM_DRAWS, [[]] * NUM_DRAWS, 12, "cpu"
    )
    tokens = torch_sample(
        logits, batch, torch.arange(NUM_DRAWS), torch.Generator().manual_seed(5)
    ).token_ids
    observed = np.bincount(tokens.numpy(), minlength=12)
    expected = reference_distribution(SP(temperature=1.0)) * NUM_DRAWS
    assert float(((observed - expected) ** 2 / expected).sum()) > chi_square_limit(11)
