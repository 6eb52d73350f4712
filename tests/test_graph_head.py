"""The sampling a decode graph runs (torch_runner/runner/graph_head.py).

Which head a batch gets; that the head's per-row inputs land on their rows; that the head's draw
over every row (padding included) picks, for greedy and seeded rows, exactly what the eager
sampler picks, and for unseeded rows follows the filtered softmax (chi-square, numpy only). On
CUDA: a captured head replayed many times follows the distribution, never repeats its noise,
and keeps greedy and seeded rows equal to eager; an engine's unseeded batch runs through it.
"""

import numpy as np
import pytest
import torch
from engine_helpers import run_staggered
from test_sampler_distribution import LOGITS, chi_square_limit, reference_distribution

from ops.sampling.batch import SamplingBatch
from ops.sampling.params import SamplingParams as SP
from ops.sampling.sampler import sample
from torch_runner import Engine
from torch_runner.runner.cuda_graphs import DecodeGraphs, capture_graph
from torch_runner.runner.graph_head import (
    GraphHead,
    HeadInputs,
    is_graph_sampled,
    sample_rows,
)

pytestmark = pytest.mark.usefixtures("one_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

V = 50
GREEDY = SP(temperature=0.0)
UNSEEDED = SP(temperature=0.8)
SEEDED = SP(temperature=0.8, seed=3)
TOPK_SEEDED = SP(temperature=0.9, top_k=20, seed=5)
TOPP = SP(temperature=1.1, top_p=0.9)
FILTERED = SP(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05)  # unseeded, every mask


def _batch(params, deterministic=False, vocab=V, device="cpu"):
    n = len(params)
    return SamplingBatch.build(params, [[1, 2]] * n, [[4]] * n, vocab, device,
                               deterministic=deterministic, eos_token_ids=[2])  # fmt: skip


def _head_inputs(batch, rows, vocab=V, device="cpu"):
    head = GraphHead.for_batch(batch, vocab)
    inputs = HeadInputs(head, rows, device)
    inputs.load(batch)
    return head, inputs


@pytest.mark.parametrize(
    "params,deterministic,want",
    [
        ([GREEDY, GREEDY], False, GraphHead(V, "greedy")),
        ([UNSEEDED, UNSEEDED], False, GraphHead(V, "plain", seeding="unseeded")),
        ([UNSEEDED, UNSEEDED], True, GraphHead(V, "plain")),  # deterministic: seed 42
        ([SEEDED, UNSEEDED], False, GraphHead(V, "plain", seeding="mixed")),
        ([GREEDY, UNSEEDED], False, GraphHead(V, "plain", seeding="unseeded", has_greedy=True)),
        ([GREEDY, SEEDED], False, GraphHead(V, "plain", has_greedy=True)),
        ([TOPP, TOPP], False, GraphHead(V, "filtering", V, True, "unseeded")),  # unbounded k
        ([TOPK_SEEDED, SP(temperature=0.5, top_k=3)], False,
         GraphHead(V, "filtering", 32, False, "mixed")),  # max top_k 20 -> width 32
        ([GREEDY, TOPK_SEEDED, UNSEEDED], False,
         GraphHead(V, "plain+filtering", 32, False, "mixed", True)),
        ([GREEDY, SP(temperature=0.7, logprobs=True)], False, None),
        ([UNSEEDED, SP(temperature=0.7, logit_bias={3: 1.0})], False, None),
        ([UNSEEDED, SP(temperature=0.7, repetition_penalty=1.1)], False, None),
        ([UNSEEDED, SP(temperature=0.7, min_tokens=2)], False, None),  # EOS ban: a logit edit
    ],
)  # fmt: skip
def test_a_batch_gets_the_head_of_its_paths_and_seeding(params, deterministic, want):
    assert GraphHead.for_batch(_batch(params, deterministic), V) == want
    assert all(is_graph_sampled(p) for p in params) == (want is not None)


def test_head_inputs_put_each_rows_values_on_its_row():
    params = [GREEDY, TOPK_SEEDED, UNSEEDED, SP(temperature=0.6, top_p=0.8, min_p=0.1, seed=9),
              SEEDED]  # fmt: skip
    head, inputs = _head_inputs(_batch(params), rows=8)
    assert inputs.paths.tolist() == [0, 2, 1, 2, 1, 1, 1, 1]  # padding: the first path
    assert inputs.is_seeded[1:5].tolist() == [True, False, True, True]
    assert inputs.seeds[[1, 3, 4]].tolist() == [5, 9, 3]
    assert inputs.temperatures.tolist() == pytest.approx([1.0, 0.9, 0.8, 0.6, 0.8, 1, 1, 1])
    assert inputs.top_ks[[1, 3]].tolist() == [20, V]
    assert inputs.top_ps[3].item() == pytest.approx(0.8)
    assert inputs.min_ps[3].item() == pytest.approx(0.1)
    again = HeadInputs(head, 8, "cpu")  # a later step: same structure, rows moved
    again.load(_batch([params[3], GREEDY, params[2], params[4], params[1]]))
    assert again.paths.tolist()[:5] == [2, 0, 1, 1, 2]
    assert again.seeds[[0, 3, 4]].tolist() == [9, 3, 5]


MIXES = {
    "every path": [GREEDY, TOPK_SEEDED, UNSEEDED, SP(temperature=0.6, top_p=0.8, min_p=0.1, seed=9),
                   SEEDED, FILTERED, GREEDY],
    "bounded filtering": [TOPK_SEEDED, SP(temperature=1.0, top_k=7), GREEDY,
                          SP(temperature=0.7, top_k=100, top_p=0.95, seed=11)],
    "plain": [SEEDED, UNSEEDED, GREEDY, SP(temperature=1.7, seed=2**63 + 5)],
}  # fmt: skip


@pytest.mark.parametrize("mix", MIXES)
def test_greedy_and_seeded_rows_pick_what_the_eager_sampler_picks(mix):
    """Every path over every padded row, then a per-row select: greedy and seeded rows equal
    ops.sample on the live rows alone; unseeded rows pick a token their filters keep."""
    params, vocab = MIXES[mix], 300
    b, rows = len(params), len(params) + 3
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    positions = torch.arange(rows) + 10
    batch = _batch(params, vocab=vocab)
    want = sample(logits[:b], batch, positions[:b], torch.Generator().manual_seed(1)).token_ids
    head, inputs = _head_inputs(batch, rows, vocab)
    for seed in (2, 3):
        got = sample_rows(logits, head, inputs, positions, torch.Generator().manual_seed(seed))
        for i, p in enumerate(params):
            if p.is_greedy or p.seed is not None:
                assert got[i] == want[i], (i, p)
            elif p.top_k != -1:
                assert got[i] in logits[i].topk(p.top_k).indices, (i, p)


@pytest.mark.parametrize("mixed", [False, True], ids=["unseeded", "with greedy and seeded"])
@pytest.mark.parametrize("p", [SP(temperature=0.7), FILTERED, SP(temperature=1.0, top_k=4)],
                         ids=["plain", "filtering", "top-k"])  # fmt: skip
def test_unseeded_rows_follow_the_filtered_softmax(p, mixed):
    """N identical unseeded rows in one head call (CPU: the code the graph runs)."""
    n = 20000
    params = [p] * n + ([GREEDY, TOPK_SEEDED, SEEDED] if mixed else [])
    logits = torch.tensor(LOGITS).repeat(len(params) + 2, 1)  # + 2 padded rows
    head, inputs = _head_inputs(_batch(params, vocab=len(LOGITS)), len(logits), len(LOGITS))
    assert head.seeding == ("mixed" if mixed else "unseeded")
    positions = torch.arange(len(logits)) + 17
    tokens = sample_rows(logits, head, inputs, positions, torch.Generator().manual_seed(5))
    _assert_follows(tokens[:n].numpy(), reference_distribution(p))


def _assert_follows(tokens: np.ndarray, probs: np.ndarray) -> None:
    observed = np.bincount(tokens, minlength=len(probs))
    expected = probs * len(tokens)
    assert observed[expected == 0].sum() == 0, "a filtered-out token was sampled"
    support = expected > 0
    stat = float((((observed - expected) ** 2)[support] / expected[support]).sum())
    assert stat < chi_square_limit(int(support.sum()) - 1), (stat, observed, expected.round(1))


def test_the_chi_square_check_rejects_the_unfiltered_law():
    """The check can fail: top-k 4 draws against the plain T=1 softmax."""
    n = 20000
    logits = torch.tensor(LOGITS).repeat(n, 1)
    head, inputs = _head_inputs(_batch([SP(temperature=1.0, top_k=4)] * n, vocab=12), n, 12)
    tokens = sample_rows(logits, head, inputs, torch.arange(n), torch.Generator().manual_seed(5))
    with pytest.raises(AssertionError):
        _assert_follows(tokens.numpy(), reference_distribution(SP(temperature=1.0)))


PROMPTS = [[5, 6, 7], [100] * 11, [42], list(range(200, 219)), list(range(20, 51))]
MAX_TOKENS = [24, 16, 20, 18, 28]


def _engine(path, device="cpu", random_seed=0, overlap=False, static=True):
    engine = Engine(path, device=device, dtype="float32", max_total_tokens=1024, block_size=4,
                    chunked_prefill_size=16, max_num_seqs=8, random_seed=random_seed,
                    async_scheduling=overlap, cuda_graph_max_bs=8)  # fmt: skip
    r = engine.runner
    if device == "cpu" and static:  # the static decode, run eagerly (what a graph captures)
        r.decode_graphs = DecodeGraphs(r.model, r.pool, r.full_layers, len(r.args.layer_types),
                                       r.device, 8, capture=False, min_keys=8,
                                       generator=r.generator)  # fmt: skip
    if r.decode_graphs is not None:
        r.decode_graphs.min_keys = 8
    return engine


def _unseeded_run(path, device="cpu", random_seed=0, overlap=False):
    """Outputs of an unseeded temperature-1 batch, and the decode steps the eager sampler took
    (chunk lists of one token each: pure decode) and the graph heads used."""
    engine = _engine(path, device, random_seed, overlap)
    r = engine.runner
    eager_decode, forward_logits = [], r.forward_logits

    def spy(chunks):
        if all(c.num_tokens == 1 for c in chunks):
            eager_decode.append(len(chunks))
        return forward_logits(chunks)

    r.forward_logits = spy
    params = [SP(max_tokens=m, temperature=1.0, ignore_eos=True) for m in MAX_TOKENS]
    outputs = run_staggered(engine, PROMPTS, params, arrive_at=(4, 9))
    return outputs, eager_decode, dict(r.decode_graphs.head_steps)


def test_an_unseeded_batch_samples_in_the_graph_and_its_seed_makes_the_run_reproducible(llama):
    """CPU, the static decode run eagerly: every pure-decode step samples in the head; the
    engine's random_seed reproduces the run and another seed changes it."""
    path, _ = llama
    outputs, eager, heads = _unseeded_run(path, random_seed=3)
    unseeded = [h for h in heads if h is not None and h.seeding == "unseeded"]
    assert eager == [] and unseeded and sum(heads[h] for h in unseeded) > 10, heads
    assert _unseeded_run(path, random_seed=3)[0] == outputs
    assert _unseeded_run(path, random_seed=4)[0] != outputs


def test_greedy_and_seeded_rows_beside_unseeded_ones_decode_as_eager_steps_do(llama):
    """CPU, the static decode run eagerly: one batch holding greedy, seeded and unseeded rows on
    both random paths samples in one head; its greedy and seeded requests get the tokens of
    the engine without the static decode (overlapped too)."""
    path, _ = llama
    params = [SP(max_tokens=m, ignore_eos=True, **kw) for m, kw in zip(MAX_TOKENS, [
        dict(temperature=0.0), dict(temperature=0.9, top_p=0.8, top_k=40, seed=7),
        dict(temperature=1.0), dict(temperature=1.3, seed=2), dict(temperature=1.0, top_k=5)])]  # fmt: skip
    want = run_staggered(_engine(path, static=False), PROMPTS, params, arrive_at=(4, 9))
    for overlap in (False, True):
        engine = _engine(path, overlap=overlap)
        got = run_staggered(engine, PROMPTS, params, arrive_at=(4, 9))
        assert [got[i] for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]
        heads = engine.runner.decode_graphs.head_steps
        assert any(h and h.kind == "plain+filtering" and h.has_greedy and h.seeding == "mixed"
                   for h in heads), heads  # fmt: skip


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_cuda_unseeded_batch_runs_through_the_graph_head(llama, overlap):
    """On CUDA: no pure-decode step of an unseeded temperature-1 batch takes the eager
    sampler; the captured graphs include unseeded heads; the engine's seed reproduces the run
    (as eager steps do) and another seed changes it."""
    path, _ = llama
    outputs, eager, heads = _unseeded_run(path, "cuda", random_seed=3, overlap=overlap)
    unseeded = [h for h in heads if h is not None and h.seeding == "unseeded"]
    assert eager == [] and unseeded and sum(heads[h] for h in unseeded) > 10, heads
    assert _unseeded_run(path, "cuda", random_seed=3, overlap=overlap)[0] == outputs
    assert _unseeded_run(path, "cuda", random_seed=4, overlap=overlap)[0] != outputs


@pytest.mark.gpu
@cuda
def test_cuda_captured_head_replays_draw_fresh_noise_from_the_distribution():
    """A head captured with unseeded, seeded and greedy rows (padded), replayed 2000 times:
    (a) unseeded rows' frequencies follow the filtered softmax; (b) tokens differ across
    replays (no repeated noise), and the generator, not the default one, advanced;
    (c) greedy and seeded rows equal the eager sampler on every replay; reseeding the
    generator replays the same tokens."""
    vocab, reps, copies = 1024, 2000, 64
    fixed = [GREEDY, SEEDED, TOPK_SEEDED, SP(temperature=0.6, top_p=0.8, seed=9)]
    uniform = SP(temperature=1.0)  # over all 1024 tokens: for (b)
    params = fixed + [SP(temperature=0.7)] * copies + [FILTERED] * copies + [uniform] * 32
    b, rows = len(params), len(params) + 5
    logits = torch.full((rows, vocab), float("-inf"))
    logits[:, : len(LOGITS)] = torch.tensor(LOGITS)  # 12 live tokens (the reference's)
    logits[: len(fixed)] = torch.randn(
        len(fixed), vocab, generator=torch.Generator().manual_seed(0)
    )
    logits[b - 32 : b] = 0.0
    logits, positions = logits.cuda(), torch.arange(rows, device="cuda") + 10
    batch = _batch(params, vocab=vocab, device="cuda")
    head, inputs = _head_inputs(batch, rows, vocab, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(11)
    graph, out = capture_graph(lambda: sample_rows(logits, head, inputs, positions, gen),
                               torch.device("cuda"), None, gen)  # fmt: skip
    default_offset, offset = torch.cuda.default_generators[0].get_offset(), gen.get_offset()
    tokens = torch.empty(reps, rows, dtype=torch.int64, device="cuda")
    for i in range(reps):
        graph.replay()
        tokens[i].copy_(out)
    tokens = tokens.cpu()
    assert (
        gen.get_offset() > offset
        and torch.cuda.default_generators[0].get_offset() == default_offset
    )
    plain = tokens[:, len(fixed) : len(fixed) + copies].flatten().numpy()
    filtered = tokens[:, len(fixed) + copies : len(fixed) + 2 * copies].flatten().numpy()
    _assert_follows(plain, np.pad(reference_distribution(SP(temperature=0.7)), (0, vocab - 12)))
    _assert_follows(filtered, np.pad(reference_distribution(FILTERED), (0, vocab - 12)))
    spread = tokens[:, b - 32 : b]
    _assert_follows(spread.flatten().numpy(), np.full(vocab, 1.0 / vocab))
    assert len({tuple(t) for t in spread.tolist()}) == reps  # no replay repeats another
    assert (spread[1:] == spread[:-1]).float().mean() < 0.01  # 1 / 1024 by chance
    want = sample(logits[:b], batch, positions[:b], torch.Generator(device="cuda")).token_ids
    assert (tokens[:, : len(fixed)] == want[: len(fixed)].cpu()).all()
    again = []
    for _ in range(2):
        gen.manual_seed(7)
        graph.replay()
        again.append(out.clone())
    assert torch.equal(again[0], again[1])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kw", [dict(), dict(top_k=40, top_p=0.9)], ids=["plain", "filtering"])
def test_cuda_overlapped_unseeded_decode_steps_never_sync_the_stream(llama, kw):
    """Steady-state overlapped decode of unseeded rows: torch's sync debug mode sees no
    blocking host-device call in a step, and every step samples in the graph."""
    import warnings

    path, _ = llama
    engine = _engine(path, "cuda", overlap=True)
    params = SP(temperature=1.0, ignore_eos=True, max_tokens=60, **kw)
    for prompt in PROMPTS[:4]:
        engine.add_request(None, prompt, params)
    for _ in range(12):  # prefill, graph capture
        engine.step()
    steps = engine.runner.decode_graphs.head_steps
    before = sum(n for h, n in steps.items() if h is not None and h.seeding == "unseeded")
    eager, forward_logits = [], engine.runner.forward_logits
    engine.runner.forward_logits = lambda chunks: eager.append(chunks) or forward_logits(chunks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(10):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchronizing CUDA operation" in str(w.message)]
    assert syncs == [], syncs[:3]
    after = sum(n for h, n in steps.items() if h is not None and h.seeding == "unseeded")
    assert eager == [] and after - before >= 10 and engine.is_overlapped
