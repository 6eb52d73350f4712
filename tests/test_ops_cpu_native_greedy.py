"""The native greedy pick (ops/cpu_native/greedy_kernels.cpp) and the sampler path that uses it.

Oracle: torch's own ops on the same logits: `nan_to_num(x.float(), nan=-inf, posinf=FLT_MAX)
.max(dim=-1).indices` (the torch sampler's greedy pick, first index on ties) and
`isfinite(x).all(dim=-1)`, over rows built to hit every case: NaN, +-inf, ties across and within
the 8 vector lanes, all -inf / all NaN rows, widths below and not a multiple of 8, bf16, a row
stride wider than the row.
"""

import pytest
import torch

from ops.cpu_native import build
from ops.sampling.batch import SamplingBatch
from ops.sampling.params import SamplingParams as SP
from ops.sampling.sampler import sample

pytestmark = pytest.mark.skipif(not build.has_avx2(), reason="needs an x86-64 CPU with AVX2")
FLT_MAX = torch.finfo(torch.float32).max


@pytest.fixture(scope="module")
def lib():
    ops = build.native_ops()
    assert ops is not None, "the native library did not build"
    return ops


def oracle(x: torch.Tensor):
    clean = torch.nan_to_num(x.float(), nan=float("-inf"), posinf=FLT_MAX)
    return clean.max(dim=-1).indices, torch.isfinite(x.float()).all(dim=-1)


def hard_rows(v: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, v, generator=g)
    x[0, :] = float("nan")
    x[1, :] = float("-inf")
    x[2, v // 2] = float("inf")
    x[3, ::2] = float("nan")
    x[4, -1] = float("inf")
    x[4, 0] = float("inf")  # two +inf: the first wins
    x[5, :] = 1.0  # all tied: index 0
    x[6, :] = torch.randint(0, 3, (v,), generator=g).float()  # many ties, spread over the lanes
    x[7, -1] = 100.0  # the maximum in the tail (past the last full 8)
    x[8, :] = float("nan")
    x[8, -1] = -5.0
    x[9, :] = float("-inf")
    x[9, v // 3] = FLT_MAX  # FLT_MAX and a later +inf tie after nan_to_num
    x[9, -1] = float("inf")
    x[10, :] = -3.0e38
    x[11, :] = float("nan")
    x[11, 0] = float("-inf")
    return x


@pytest.mark.parametrize("v", [1, 5, 8, 13, 64, 1000, 49152])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_pick_matches_torch(lib, v, dtype):
    x = torch.cat([hard_rows(v, v), torch.randn(3, v) * 4]).to(dtype)
    ids, finite = lib.greedy_pick(x)
    want_ids, want_finite = oracle(x)
    assert torch.equal(ids, want_ids), (ids, want_ids)
    assert torch.equal(finite, want_finite)


def test_greedy_pick_reads_strided_rows(lib):
    wide = torch.randn(4, 1030)
    wide[:, 1000:] = 1e9  # past the rows' end: must not be read
    x = wide[:, :1000]
    ids, finite = lib.greedy_pick(x)
    want_ids, want_finite = oracle(x.contiguous())
    assert torch.equal(ids, want_ids) and torch.equal(finite, want_finite)


def test_greedy_pick_rejects_bad_input(lib):
    with pytest.raises(RuntimeError, match="dtype must be float32 or bfloat16"):
        lib.greedy_pick(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="unit column stride"):
        lib.greedy_pick(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="2-D CPU tensor"):
        lib.greedy_pick(torch.zeros(8))


def _batch(params, vocab):
    n = len(params)
    return SamplingBatch.build(params, [[]] * n, [[]] * n, vocab, "cpu")


def test_sampler_takes_the_native_pick_only_where_it_gives_the_same_tokens(lib, monkeypatch):
    vocab = 4099
    x = torch.cat([hard_rows(vocab, 3), torch.randn(5, vocab)])
    positions = torch.arange(x.shape[0])
    greedy = [SP(temperature=0)] * x.shape[0]
    out = sample(x, _batch(greedy, vocab), positions)
    assert out.finite is not None, "an all-greedy CPU batch takes the native pick"
    monkeypatch.setattr("ops.sampling.sampler.loaded_ops", lambda: None)  # the torch path
    ref = sample(x, _batch(greedy, vocab), positions)
    assert ref.finite is None and torch.equal(out.token_ids, ref.token_ids)
    assert torch.equal(out.finite, oracle(x)[1])
    monkeypatch.undo()
    for params in ([SP(temperature=0, logprobs=True)] * x.shape[0],
                   [SP(temperature=0, logit_bias={5: 3.0})] * x.shape[0],
                   [SP(temperature=0, repetition_penalty=1.3)] * x.shape[0],
                   [SP(temperature=0)] * (x.shape[0] - 1) + [SP(temperature=0.7, seed=1)]):  # fmt: skip
        assert sample(x, _batch(params, vocab), positions).finite is None
