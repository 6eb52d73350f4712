"""Sampler contract (torch reference and MLX variant): greedy, seeded, bounded vs full, edits,
penalties, logprobs, NaN / inf. Oracles: numpy / pure-Python references, transformers'
RepetitionPenaltyLogitsProcessor, torch.log_softmax."""

import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from ops.sampling.batch import SamplingBatch
from ops.sampling.params import SamplingParamError
from ops.sampling.params import SamplingParams as SP
from ops.sampling.sampler import sample as torch_sample
from tests.test_sampler_hash import reference_gumbel


def _mlx_sample():
    pytest.importorskip("mlx.core")
    from ops.mlx.sampling import sample

    return sample


@pytest.fixture(params=["torch", "mlx"])
def sample(request):
    return torch_sample if request.param == "torch" else _mlx_sample()


def build(params, vocab, prompt=None, output=None, **kwargs):
    n = len(params)
    return SamplingBatch.build(
        params, prompt or [[]] * n, output or [[]] * n, vocab, "cpu", **kwargs
    )


def run(sample, logits, params, positions=None, seed=0, **kwargs):
    batch = build(params, logits.shape[1], **kwargs)
    if positions is None:
        positions = torch.arange(len(params))
    return sample(logits, batch, torch.as_tensor(positions), torch.Generator().manual_seed(seed))


def rand_logits(rows, vocab, scale=2.0, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def reference_seeded_token(row, p: SP, seed: int, pos: int) -> int:
    """argmax(scaled + g) over the filtered vocabulary, straight from the definitions."""
    scaled = row.numpy().astype(np.float32) / np.float32(p.temperature)
    probs = np.exp(scaled.astype(np.float64) - np.logaddexp.reduce(scaled.astype(np.float64)))
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, cum = set(), 0.0
    for rank, tok in enumerate(order):
        if (
            (p.top_k == -1 or rank < p.top_k)
            and cum <= p.top_p
            and probs[tok] >= probs[order[0]] * p.min_p
        ):
            keep.add(tok)
        cum += probs[tok]
    noise = reference_gumbel(seed, pos, range(len(probs)))
    keys = [scaled[t] + noise[t] if t in keep else -np.inf for t in range(len(probs))]
    return int(np.argmax(keys))


def test_greedy_rows_exact_in_mixed_batch(sample):
    logits = rand_logits(6, 500)
    params = [
        SP(temperature=0),
        SP(top_k=3),
        SP(temperature=0),
        SP(seed=5),
        SP(top_p=0.5),
        SP(temperature=0),
    ]
    out = run(sample, logits, params)
    for r in (0, 2, 5):
        assert out.token_ids[r] == logits[r].argmax()
    assert out.token_ids.dtype == torch.int64 and out.logprobs is None


def test_greedy_batch_consumes_no_randomness(sample):
    logits = rand_logits(4, 300)
    gen = torch.Generator().manual_seed(3)
    before = gen.get_state()
    out = sample(logits, build([SP(temperature=0)] * 4, 300), torch.arange(4), gen)
    assert torch.equal(gen.get_state(), before)
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.mark.parametrize(
    "p",
    [
        SP(temperature=0.8, seed=11),
        SP(top_k=20, seed=2**63 + 12345),
        SP(top_p=0.7, min_p=0.05, seed=0, temperature=1.3),
    ],
    ids=["plain", "top_k", "top_p_min_p"],
)
def test_seeded_row_matches_float32_reference(sample, p):
    logits = rand_logits(1, 64, seed=1).repeat(24, 1)
    positions = list(range(1000, 1024))
    out = run(sample, logits, [p] * 24, positions=positions)
    expected = [reference_seeded_token(logits[0], p, p.seed, pos) for pos in positions]
    assert out.token_ids.tolist() == expected
    assert len(set(expected)) > 3  # the draws really vary with the position


def test_seeded_row_independent_of_batchmates_and_rng(sample):
    logits = rand_logits(8, 2000, seed=4)
    seeded = SP(top_k=40, top_p=0.9, seed=1234)
    alone = [
        run(sample, logits[r : r + 1], [seeded], positions=[r + 50], seed=r).token_ids[0]
        for r in range(8)
    ]
    mates = [
        SP(),
        SP(temperature=0),
        SP(top_p=0.3),
        SP(top_k=-1, min_p=0.2),
        SP(seed=9, top_k=2000),
    ]
    params = [seeded if r % 2 == 0 else mates[r // 2] for r in range(8)]
    mixed = run(sample, logits, params, positions=[r + 50 for r in range(8)], seed=99).token_ids
    for r in range(0, 8, 2):
        assert mixed[r] == alone[r]


def test_bounded_equals_full_for_seeded_rows(sample):
    logits = rand_logits(1, 3000, seed=6).repeat(32, 1)
    seeded = SP(top_k=100, top_p=0.95, temperature=1.5, seed=77)
    bounded = build([seeded] * 32, 3000)
    full = build([seeded] * 32 + [SP(top_k=-1, top_p=0.5)], 3000)  # one top_k=-1 row forces V
    assert bounded.filter_params.width == 100 and full.filter_params.width == 3000
    positions = torch.arange(32)
    a = sample(logits, bounded, positions, torch.Generator().manual_seed(0)).token_ids
    b = sample(
        torch.cat([logits, logits[:1]]), full, torch.cat([positions, positions[:1]]), None
    ).token_ids
    assert torch.equal(a, b[:32])
    assert len(set(a.tolist())) > 5


def test_unseeded_rows_follow_the_generator(sample):
    logits = rand_logits(16, 400, scale=0.5)
    params = [SP(), SP(top_k=50)] * 8
    a, b, c = (run(sample, logits, params, seed=s).token_ids for s in (1, 1, 2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def reference_penalised(logits, params, prompts, outputs):
    """HF repetition processor over prompt + output, then OpenAI presence / frequency."""
    rows = []
    for r, p in enumerate(params):
        x = logits[r : r + 1].clone()
        seen = torch.tensor([prompts[r] + outputs[r]])
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seen, x)[0]
        for tok in set(outputs[r]):
            x[tok] -= p.frequency_penalty * outputs[r].count(tok) + p.presence_penalty
        rows.append(x)
    return torch.stack(rows)


def test_penalties_match_reference(sample):
    vocab = 16
    logits = rand_logits(4, vocab, seed=8)
    params = [
        SP(temperature=0, repetition_penalty=1.7, logprobs=True, top_logprobs=vocab),
        SP(
            temperature=0,
            presence_penalty=1.5,
            frequency_penalty=-0.5,
            logprobs=True,
            top_logprobs=vocab,
        ),
        SP(
            temperature=0,
            repetition_penalty=0.6,
            presence_penalty=-2,
            frequency_penalty=2,
            logprobs=True,
        ),
        SP(temperature=0),
    ]
    prompts = [[0, 1, 2, 3], [4, 5], [6, 7, 7], [1, 2]]
    outputs = [[3, 9, 9], [5, 5, 5, 10], [7, 11, 11], [0]]
    out = run(sample, logits, params, prompt=prompts, output=outputs)
    expected = reference_penalised(logits, params, prompts, outputs)
    assert out.token_ids.tolist() == expected.argmax(-1).tolist()
    ids, values = out.top_logprobs
    for r in range(4):
        got = torch.empty(vocab).scatter_(0, ids[r], values[r])
        torch.testing.assert_close(got, torch.log_softmax(expected[r], -1), rtol=1e-5, atol=1e-5)


def test_logprobs_are_log_softmax_of_scaled_edited_logits(sample):
    logits = rand_logits(3, 300, seed=9)
    bias = {5: 3.0, 17: -100.0}
    params = [
        SP(temperature=0.7, logprobs=True, top_logprobs=5),
        SP(temperature=0, logprobs=True, top_logprobs=20, logit_bias=bias),
        SP(top_k=10, temperature=1.9, logprobs=True),
    ]
    out = run(sample, logits, params)
    edited = logits.clone()
    edited[1, 5] += 3.0
    edited[1, 17] -= 100.0
    expected = torch.log_softmax(edited / torch.tensor([[0.7], [1.0], [1.9]]), -1)
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.token_ids[:, None])[:, 0])
    values, ids = expected.topk(20, -1)
    assert out.top_logprobs[0].shape == (3, 20)  # the batch's largest request; rows keep theirs
    assert torch.equal(out.top_logprobs[0], ids)
    torch.testing.assert_close(out.top_logprobs[1], values)


def test_logit_bias_edit_rows_and_min_tokens(sample):
    logits = rand_logits(3, 100, seed=10)
    top = logits.argmax(-1)
    forbid = torch.zeros(100)
    forbid[top[1]] = float("-inf")
    params = [
        SP(temperature=0, logit_bias={42: 100.0}),
        SP(temperature=0),
        SP(temperature=0, min_tokens=2, stop_token_ids=[7]),
    ]
    logits[2, top[2]] = -50.0  # make the EOS / stop candidates the best tokens of row 2
    logits[2, 3] = 60.0
    logits[2, 7] = 59.0
    out = run(
        sample,
        logits,
        params,
        output=[[], [], [1]],
        edit_rows=[None, forbid, None],
        eos_token_ids=[3],
    )
    assert out.token_ids[0] == 42
    assert (
        out.token_ids[1] == torch.where(torch.arange(100) == top[1], -math.inf, logits[1]).argmax()
    )
    assert out.token_ids[2] not in (3, 7)
    done = run(sample, logits, params, output=[[], [], [1, 2]], eos_token_ids=[3])
    assert done.token_ids[2] == 3  # min_tokens reached: EOS allowed again


def test_nan_and_inf_logits_never_give_nan(sample):
    vocab = 50
    logits = rand_logits(6, vocab, seed=11)
    logits[0, :] = float("nan")
    logits[1, :] = float("-inf")
    logits[2, 10] = float("inf")
    logits[3, ::2] = float("nan")
    logits[4, 20] = float("inf")
    logits[5, :] = float("nan")
    logits[5, 33] = 1.0
    params = [
        SP(top_p=0.9, logprobs=True),
        SP(logprobs=True),
        SP(temperature=0, logprobs=True),
        SP(seed=1, top_k=5, logprobs=True),
        SP(temperature=0.3, logprobs=True),
        SP(temperature=0, logprobs=True),
    ]
    for p_mix in (
        params,
        [SP(temperature=0.5, logprobs=True)] * 6,
        [SP(top_k=-1, top_p=0.99, min_p=0.1, logprobs=True)] * 6,
    ):
        out = run(sample, logits, p_mix)
        assert ((out.token_ids >= 0) & (out.token_ids < vocab)).all()
        assert not torch.isnan(out.logprobs).any()
        assert out.token_ids[3] % 2 == 1  # NaN columns never win
        assert out.token_ids[5] == 33
    assert (
        run(sample, logits, params).token_ids[2] == 10
        and run(sample, logits, params).token_ids[4] == 20
    )


def test_logit_bias_out_of_vocab_names_field():
    with pytest.raises(SamplingParamError) as info:
        build([SP(logit_bias={100: 1.0})], 100)
    assert info.value.param == "logit_bias" and "0..99" in str(info.value)


def test_deterministic_mode_seeds_every_row_with_42():
    batch = build([SP(), SP(top_k=5), SP(seed=7, top_k=3)], 10, deterministic=True)
    assert batch.plain.is_all_seeded and batch.plain.seeds.tolist() == [42]
    assert batch.filtering.seeds.tolist() == [42, 7]


def test_mlx_and_torch_pick_same_greedy_and_seeded_tokens():
    mlx_sample = _mlx_sample()
    logits = rand_logits(12, 5000, seed=12)
    params = [
        SP(temperature=0),
        SP(seed=1),
        SP(seed=2, top_k=30),
        SP(seed=3, top_p=0.8),
        SP(seed=4, min_p=0.05),
    ] * 2
    params += [
        SP(seed=5, repetition_penalty=1.2, presence_penalty=0.4),
        SP(temperature=0, logit_bias={9: 50.0}),
    ]
    kwargs = {"prompt": [[1, 2, 3]] * 12, "output": [[4, 4, 5]] * 12}
    a = run(torch_sample, logits, params, positions=list(range(40, 52)), **kwargs)
    b = run(mlx_sample, logits, params, positions=list(range(40, 52)), **kwargs)
    assert torch.equal(a.token_ids, b.token_ids)


def test_top_p_rows_of_every_nucleus_size_match_reference(sample):
    """Nuclei within 64 candidates, within 1024, and beyond (the CPU path's three tiers) mixed
    in one batch: every seeded row still picks the reference token."""
    vocab = 3000
    rows = [
        rand_logits(1, vocab, scale=4.0, seed=13)[0],
        rand_logits(1, vocab, scale=2.5, seed=17)[0],
    ]
    rows.append(rand_logits(1, vocab, scale=0.1, seed=14)[0])
    sizes = [
        int((torch.softmax(r / 0.9, -1).sort(descending=True).values.cumsum(0) < 0.9).sum()) + 1
        for r in rows
    ]
    assert sizes[0] <= 64 < sizes[1] <= 1024 < sizes[2]
    logits = torch.stack(rows * 4)
    params = [
        SP(top_p=0.9, seed=r, temperature=0.9, min_p=0.0 if r % 4 else 0.01) for r in range(12)
    ]
    out = run(sample, logits, params, positions=list(range(300, 312)))
    expected = [reference_seeded_token(logits[r], params[r], r, 300 + r) for r in range(12)]
    assert out.token_ids.tolist() == expected


def test_registry_routes_sampler_to_both_implementations():
    import importlib

    from ops.mlx.sampling import sample as mlx_impl
    from ops.registry import OPS

    def resolve(path):
        module, name = path.split(":")
        return getattr(importlib.import_module(module), name)

    torch_path, mlx_path = OPS["sampler"]
    assert resolve(torch_path) is torch_sample
    assert resolve(mlx_path) is mlx_impl


def test_logits_shape_must_match_the_batch(sample):
    batch = build([SP(), SP()], 10)
    with pytest.raises(ValueError, match=r"logits has shape \(2, 11\)"):
        sample(torch.zeros(2, 11), batch, torch.arange(2), None)
    with pytest.raises(ValueError, match="positions"):
        sample(torch.zeros(2, 10), batch, torch.arange(3), None)


def test_input_logits_are_never_modified(sample):
    logits = rand_logits(5, 200, seed=15)
    logits[0, 3] = float("nan")
    before = logits.clone()
    params = [
        SP(temperature=0),
        SP(),
        SP(top_p=0.8, logprobs=True),
        SP(seed=3, min_p=0.1),
        SP(repetition_penalty=1.5),
    ]
    run(sample, logits, params, output=[[1, 2]] * 5)
    run(sample, logits, [SP(temperature=0)] * 5)
    assert torch.equal(logits.nan_to_num(), before.nan_to_num()) and logits[0, 3].isnan()


def test_penalty_ids_outside_the_vocabulary_do_not_leak_into_other_rows():
    logits = torch.zeros(2, 8)
    logits[1, 2] = 1.0  # flat index 8 + 2 == row 0's token 10 (outside V) if ids were not checked
    params = [
        SP(temperature=0, repetition_penalty=2.0),
        SP(temperature=0, repetition_penalty=2.0, logprobs=True),
    ]
    batch = build(params, 8, prompt=[[10], []], output=[[], []])
    assert batch.penalties.seen.sum() == 0
    out = torch_sample(logits, batch, torch.arange(2))
    assert out.token_ids[1] == 2
