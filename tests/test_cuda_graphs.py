"""The static-shape decode behind CUDA graphs (torch_runner/runner/cuda_graphs.py).

On CPU the static forward runs eagerly: padded batch buckets, bucketed key widths and masks
built from tensors must give the eager path's logits (fp32, tight tolerance) and transformers'
greedy tokens. On CUDA, graph replay must equal the eager engine.
"""

import pytest
import torch
from engine_helpers import hf_greedy, run_staggered

from ops.sampling.batch import SamplingBatch
from ops.sampling.sampler import sample
from torch_runner import Engine, SamplingParams
from torch_runner.runner.cuda_graphs import DecodeGraphs, batch_buckets, key_bucket
from torch_runner.runner.graph_head import GraphHead, greedy_tokens, is_graph_sampled

GREEDY = dict(temperature=0.0, ignore_eos=True)
# contexts from 2 to ~60 tokens: with block size 4 and min_keys 8 the key width crosses the
# 8 / 16 / 32 / 64 buckets, and 5 -> 1 live rows use batch buckets 8, 4, 2, 1 (padded rows)
PROMPTS = [[5, 6, 7], [100] * 11, [42], list(range(200, 219)), list(range(20, 51))]
MAX_TOKENS = [24, 16, 20, 18, 28]


pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(path, device="cpu", **kwargs):
    defaults = dict(max_total_tokens=1024, block_size=4, chunked_prefill_size=16, max_num_seqs=8)
    return Engine(path, device=device, dtype="float32", **{**defaults, **kwargs})


def _static(engine, max_bs=8, capture=False):
    r = engine.runner
    graphs = DecodeGraphs(r.model, r.pool, r.full_layers, len(r.args.layer_types), r.device,
                          max_bs, capture=capture, min_keys=8,
                          generator=r.generator)  # fmt: skip
    r.decode_graphs = graphs
    return graphs


def _run(engine, staggered=True):
    """Greedy outputs of PROMPTS, two of them arriving while the others decode."""
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in MAX_TOKENS]
    return run_staggered(engine, PROMPTS, params, arrive_at=(4, 9) if staggered else ())


def test_buckets_cover_every_batch_and_context():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert batch_buckets(5) == (1, 2, 4, 5)
    assert batch_buckets(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100)
    assert batch_buckets(1) == (1,)
    for n in range(1, 300):
        s = key_bucket(n, 16)
        assert s >= max(n, 64) and s % 16 == 0 and (s == 64 or s < 2 * n + 16)
    assert key_bucket(65, 24) == 144  # 128 rounded up to whole blocks


def test_static_decode_logits_equal_the_eager_path(llama):
    """Every decode group of a mixed, staggered run: static (padded, bucketed) logits equal the
    eager path's on the same pool state."""
    path, _ = llama
    engine = _engine(path)
    runner = engine.runner
    graphs = _static(engine)
    runner.graph_sampling = False  # every decode group through _forward_group, compared below
    eager_forward = runner._forward_group
    seen = set()

    def both(group):
        if not graphs.can_run(group):
            return eager_forward(group)
        runner.decode_graphs = None
        eager = eager_forward(group)  # writes this step's K/V; the static pass rewrites them
        runner.decode_graphs = graphs
        static = graphs.forward(group)
        assert static.shape == eager.shape
        want = runner.model.compute_logits(eager)
        got = runner.model.compute_logits(static)
        # fp32 rounding only: the padded GEMMs and the wider masked softmax reorder sums
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        rows = next(b for b in graphs.buckets if b >= len(group))
        width = max(c.start for c in group) + 1
        seen.add((rows, len(group), key_bucket(width, 4, 8)))
        return eager

    runner._forward_group = both
    outputs = _run(engine)
    assert {s for _, _, s in seen} >= {8, 16, 32, 64}  # key buckets crossed
    assert any(rows > b for rows, b, _ in seen)  # padded rows exercised
    assert {rows for rows, _, _ in seen} >= {1, 2, 4, 8}
    assert runner.pool.k[:, runner.pool.pad_slot].abs().max() == 0  # padding never wrote there
    assert len(outputs) == len(PROMPTS)


def test_static_decode_greedy_tokens_equal_transformers(llama):
    path, hf = llama
    engine = _engine(path)
    _static(engine, max_bs=4)  # 5 live rows > 4: that group falls back to the eager path
    outputs = _run(engine)
    for prompt, tokens, m in zip(PROMPTS, outputs, MAX_TOKENS):
        assert tokens == hf_greedy(hf, prompt, m), prompt


def _logits_with_bad_rows(rows: int, vocab: int, dtype) -> torch.Tensor:
    """Random logits with many ties (rounded), a NaN, a +inf, an all -inf and an all-NaN row."""
    gen = torch.Generator().manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 2).round().to(dtype)
    logits[1, 5], logits[2, 7], logits[3], logits[4] = float("nan"), float("inf"), -float("inf"), float("nan")  # fmt: skip
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_the_samplers_greedy_pick_and_flag_non_finite_rows(dtype):
    """greedy_tokens == ops.sample over an all-greedy batch (first index on ties), with
    model_runner's non-finite flag (-1 where a row holds NaN/inf)."""
    logits = _logits_with_bad_rows(7, 300, dtype)
    params = [SamplingParams(temperature=0.0)] * 7
    batch = SamplingBatch.build(params, [[1]] * 7, [[]] * 7, 300, "cpu")
    want = sample(logits, batch, torch.arange(7)).token_ids
    tokens, picks = greedy_tokens(logits)
    assert torch.equal(picks, want)
    is_finite = torch.tensor([r not in (1, 2, 3, 4) for r in range(7)])
    assert torch.equal(tokens, torch.where(is_finite, want, -1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(1, 128256), (5, 300), (64, 4097), (256, 32000)])
def test_greedy_pick_kernel_equals_the_reference(shape):
    from ops.fused.triton_kernels import greedy_pick

    logits = _logits_with_bad_rows(*shape, torch.bfloat16) if shape[0] > 4 else None
    if logits is None:
        logits = torch.randn(shape).round().to(torch.bfloat16)
    cpu = greedy_tokens(logits)
    cuda = greedy_pick(logits.cuda())
    assert all(torch.equal(a.cpu(), b) for a, b in zip(cuda, cpu))


@pytest.mark.parametrize(
    "params,deterministic,head",
    [
        (dict(temperature=0.0), False, "greedy"),
        (dict(temperature=0.0, seed=3, top_k=5, stop=["x"], max_tokens=4), False, "greedy"),
        (dict(temperature=0.0, logprobs=True), False, None),
        (dict(temperature=0.0, logit_bias={3: 1.0}), False, None),
        (dict(temperature=0.0, repetition_penalty=1.2), False, None),
        (dict(temperature=0.0, presence_penalty=0.5), False, None),
        (dict(temperature=0.0, min_tokens=2), False, None),
        (dict(temperature=0.7), False, "plain"),  # unseeded: the generator, in the graph too
        (dict(temperature=0.7), True, "plain"),  # deterministic: seed 42
        (dict(temperature=0.7, seed=1), False, "plain"),
        (dict(temperature=0.7, top_p=0.9, seed=1), False, "filtering"),
        (dict(temperature=0.7, top_k=20, seed=1, min_p=0.1), False, "filtering"),
        (dict(temperature=0.7, top_k=20, seed=1, logprobs=True), False, None),
        (dict(temperature=0.7, seed=1, min_tokens=1), False, None),
    ],
)
def test_graph_sampled_rows_are_those_a_graph_head_takes(params, deterministic, head):
    """is_graph_sampled (decided before the forward, from the params) admits exactly the rows
    whose SamplingBatch gets a graph head."""
    p = SamplingParams(**params)
    batch = SamplingBatch.build([p, p], [[1, 2], [3]], [[4], []], 50, "cpu",
                                deterministic=deterministic, eos_token_ids=[2])  # fmt: skip
    got = GraphHead.for_batch(batch, 50)
    assert is_graph_sampled(p) == (got is not None)
    assert (got and got.kind) == head


def _spy(graphs, record):
    """Wrap graphs.forward; returns the list of record(*args, **kwargs) of every call."""
    seen, forward = [], graphs.forward

    def spy(*args, **kwargs):
        seen.append(record(*args, **kwargs))
        return forward(*args, **kwargs)

    graphs.forward = spy
    return seen


def test_greedy_graph_steps_equal_the_eager_sampler_and_transformers(llama):
    """All-greedy decode steps pick inside the (eager on CPU) static forward; a batch with a
    seeded sampled row too (a head with greedy rows). Tokens equal the engine without the
    static decode."""
    path, hf = llama
    seeded = [SamplingParams(max_tokens=m, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]  # fmt: skip
    for mixed in (False, True):
        params = [SamplingParams(max_tokens=m, **GREEDY) for m in MAX_TOKENS]
        if mixed:
            params[1] = seeded[1]
        want = run_staggered(_engine(path), PROMPTS, params, arrive_at=(4, 9))
        engine = _engine(path)
        graphs = _static(engine)
        calls = _spy(graphs, lambda g, t=None, f=None, head=None, batch=None: head)
        got = run_staggered(engine, PROMPTS, params, arrive_at=(4, 9))
        assert got == want
        assert GraphHead(engine.runner.vocab_size, "greedy") in calls  # the greedy graph path
        if not mixed:
            for prompt, tokens, m in zip(PROMPTS, got, MAX_TOKENS):
                assert tokens == hf_greedy(hf, prompt, m), prompt
        else:  # steps holding the sampled row: greedy rows picked beside it
            assert any(h is not None and h.has_greedy for h in calls), calls


SEEDED = {
    "filtering": lambda i, m: SamplingParams(
        max_tokens=m, temperature=0.9, top_p=0.8, top_k=40, seed=7 + i, ignore_eos=True
    ),  # fmt: skip
    "plain": lambda i, m: SamplingParams(max_tokens=m, temperature=1.3, seed=i, ignore_eos=True),
}


@pytest.mark.parametrize("kind", ["filtering", "plain", "deterministic"])
def test_seeded_graph_steps_sample_what_the_eager_sampler_samples(llama, kind):
    """All rows seeded on one path (or the deterministic mode's default seed): the static
    forward samples inside (a graph head with per-row inputs); the tokens equal the engine
    without the static decode, overlapped too (chained rows read the picks)."""
    path, _ = llama
    make = SEEDED.get(kind, lambda i, m: SamplingParams(max_tokens=m, temperature=0.8,
                                                        ignore_eos=True))  # fmt: skip
    params = [make(i, m) for i, m in enumerate(MAX_TOKENS)]
    extra = dict(enable_deterministic_inference=True) if kind == "deterministic" else {}
    want = run_staggered(_engine(path, **extra), PROMPTS, params, arrive_at=(4, 9))
    assert want != run_staggered(_engine(path, **extra), PROMPTS, params[::-1], arrive_at=(4, 9))
    for overlap in (False, True):
        engine = _engine(path, async_scheduling=overlap, **extra)
        heads = _spy(_static(engine), lambda g, t=None, f=None, head=None, batch=None: head)
        assert run_staggered(engine, PROMPTS, params, arrive_at=(4, 9)) == want
        kinds = {h.kind for h in heads if h is not None}
        assert kinds == {"plain" if kind != "filtering" else kind}
        if kind == "filtering":  # top_k 40: the eager sampler's width 40, the graph's 64
            assert {h.width for h in heads if h is not None} == {64}


def _greedy(i, m):
    return SamplingParams(max_tokens=m, **GREEDY)


MAKERS = {
    **SEEDED,
    "greedy": _greedy,
    "mixed": lambda i, m: (_greedy, SEEDED["filtering"], SEEDED["plain"])[i % 3](i, m),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["filtering", "plain", "greedy", "mixed"])
def test_cuda_graph_heads_sample_what_the_eager_sampler_samples(llama, kind):
    """On CUDA: the same graphs' hidden states sampled inside the graph or by the eager
    sampler give the same tokens (seeded rows: the hash contract; greedy: the Triton pick;
    mixed: greedy, seeded filtering and seeded plain rows in one batch, a per-row select)."""
    path, _ = llama
    make = MAKERS[kind]
    params = [make(i, m) for i, m in enumerate(MAX_TOKENS)]
    runs = []
    for inside in (False, True):
        engine = _engine(path, device="cuda", cuda_graph_max_bs=8, async_scheduling=True)
        engine.runner.graph_sampling = inside
        engine.runner.decode_graphs.min_keys = 8
        runs.append(run_staggered(engine, PROMPTS, params, arrive_at=(4, 9)))
        graphs = engine.runner.decode_graphs
        heads = {head for head, steps in graphs.head_steps.items() if steps}  # replayed
        assert (heads != {None}) == inside
    assert runs[0] == runs[1]


def test_overlapped_greedy_graph_steps_chain_on_picks_and_end_a_non_finite_row(llama):
    """Overlapped (chained rows read the previous step's picks) and with NaN logits in one row:
    that request ends with an error, its batchmates equal the synchronous eager engine."""
    path, _ = llama
    prompts = [[5, 6, 7, 8], [1, 2, 77, 3], list(range(20, 41))]
    params = SamplingParams(max_tokens=12, **GREEDY)

    def run(engine):
        def hook(module, inputs, output):
            return output.masked_fill((inputs[0] == 77)[..., None], float("nan"))

        engine.runner.model.model.embed_tokens.register_forward_hook(hook)
        outs = engine.generate(prompts, params)
        return [(o.token_ids, o.finish_reason) for o in outs]

    want = run(_engine(path, enable_prefix_caching=False))
    engine = _engine(path, enable_prefix_caching=False, async_scheduling=True)
    graphs = _static(engine)
    chained = _spy(graphs, lambda group, tokens=None, future=None, *a: future is not None)
    assert run(engine) == want
    assert want[1] == ([], "error") and sum(chained) > 5


def test_graphs_stay_off_on_cpu_and_with_enforce_eager(llama):
    path, _ = llama
    assert _engine(path).runner.decode_graphs is None  # CPU: eager
    if torch.cuda.is_available():
        assert _engine(path, device="cuda", enforce_eager=True).runner.decode_graphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_equals_eager(llama):
    path, hf = llama
    eager = _run(_engine(path, device="cuda", enforce_eager=True))
    engine = _engine(path, device="cuda", cuda_graph_max_bs=8)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.capture
    graphs.min_keys = 8  # small buckets, so this short run crosses several
    warmed = set(graphs.graphs)  # start-up's (min_keys 64) graphs
    replayed = _run(engine)
    assert replayed == eager
    assert len(set(graphs.graphs) - warmed) >= 4  # several (batch, key) buckets were captured
    for prompt, tokens, m in zip(PROMPTS, replayed, MAX_TOKENS):
        assert tokens == hf_greedy(hf, prompt, m), prompt
    # all-greedy steps replayed graphs that pick the tokens; replay and the same static forward
    # run eagerly pick the same ones
    greedy = GraphHead(engine.runner.vocab_size, "greedy")
    picked = [(k, v) for k, v in graphs.graphs.items() if k[2] == greedy]
    assert picked, [k for k in graphs.graphs]  # some captured graphs pick the tokens themselves
    (rows, keys, head), (graph, inputs, _, out) = picked[0]
    graph.replay()
    from torch_runner.runner.cuda_graphs import static_head

    r = engine.runner
    again = static_head(r.model, r.pool, r.full_layers, len(r.args.layer_types), inputs, keys,
                        head, None)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(out, again))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_captured_on_the_server_thread_equal_eager(llama):
    """AsyncEngine steps (and so captures) on a background thread, as the server does."""
    import asyncio

    from torch_runner.async_engine import AsyncEngine

    path, _ = llama
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in MAX_TOKENS]
    eager = _engine(path, device="cuda", enforce_eager=True).generate(PROMPTS, params)
    server = AsyncEngine(_engine(path, device="cuda"))
    server.start()

    async def one(i):
        outs = [o async for o in server.generate(f"r{i}", PROMPTS[i], params[i])]
        return outs[-1].token_ids

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    try:
        streamed = asyncio.run(main())
    finally:
        server.shutdown()
    assert sum(server.engine.runner.decode_graphs.head_steps.values())  # decode replayed graphs
    assert streamed == [o.token_ids for o in eager]


@pytest.mark.parametrize("block_size,min_keys,max_keys", [(4, 8, 100), (16, 64, 4096), (16, 64, 1)])
def test_warm_up_key_buckets_are_every_bucket_a_context_maps_to(
    llama, block_size, min_keys, max_keys
):
    graphs = _static(_engine(llama[0], block_size=block_size))
    graphs.min_keys = min_keys
    hit = sorted({key_bucket(n, block_size, min_keys) for n in range(1, max_keys + 1)})
    assert graphs.key_buckets(max_keys) == hit
    assert graphs.warm_up(max_keys, [None]) == 0  # capture off (CPU): nothing to capture


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_start_up_captures_the_graphs_so_serving_captures_none(llama):
    """eager_warmup auto captures every batch x key bucket x common head before serving; a
    mixed greedy / unseeded-random run inside those buckets then captures nothing new, and its
    greedy outputs equal the eager engine's."""
    path, hf = llama
    engine = _engine(path, device="cuda", cuda_graph_max_bs=8)
    graphs = engine.runner.decode_graphs
    keys = graphs.key_buckets(min(engine.config.cuda_graph_warmup_keys, engine.max_model_len))
    assert len(graphs.graphs) == len(graphs.buckets) * len(keys) * 3
    before = set(graphs.graphs)
    greedy = _run(engine)
    params = [SamplingParams(max_tokens=m, temperature=0.8, ignore_eos=True) for m in MAX_TOKENS]
    sampled = run_staggered(engine, PROMPTS, params, arrive_at=(4, 9))
    assert set(graphs.graphs) == before  # no capture while serving
    assert [len(t) for t in sampled] == MAX_TOKENS
    assert greedy == _run(_engine(path, device="cuda", enforce_eager=True))
    for lazy in (dict(eager_warmup="off"), dict(cuda_graph_warmup_keys=0)):
        off = _engine(path, device="cuda", cuda_graph_max_bs=8, **lazy)
        assert not off.runner.decode_graphs.graphs  # lazy, as before


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.6, top_p=0.9),  # Llama's generation_config
        dict(temperature=1.0, top_k=64, top_p=0.95),  # Gemma's
        dict(temperature=0.7),
        dict(temperature=0.0),
        dict(temperature=0.8, repetition_penalty=1.1),  # penalties: the eager sampler
        dict(temperature=0.8, seed=3),
    ],
)
def test_the_warmed_head_is_the_one_a_batch_of_those_requests_samples_with(llama, params):
    """graph_head_for (start-up warm-up of the server's default sampling) names the head the
    runner picks for a real batch of such requests, whatever its size."""
    from torch_runner.runner.warmup import graph_head_for

    engine = _engine(llama[0])
    runner = engine.runner
    _static(engine)  # CPU: the same decision code, graphs not captured
    sp = SamplingParams(max_tokens=4, **params)
    expected = None
    if is_graph_sampled(sp):
        batch = SamplingBatch.build([sp] * 3, [[5, 6], [7], [8, 9, 10]], [[1], [], [2, 3]],
                                    runner.vocab_size, runner.device,
                                    eos_token_ids=runner.eos_token_ids)  # fmt: skip
        expected = GraphHead.for_batch(batch, runner.vocab_size)
        if sp.is_greedy:
            expected = GraphHead(runner.vocab_size, "greedy")
    assert graph_head_for(runner, sp) == expected
    assert engine.warm_up_sampling(sp) == 0  # CPU: nothing captured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warming_the_default_sampling_captures_what_its_requests_replay(llama):
    """A server's default top_p warmed at start-up: serving such requests captures nothing."""
    engine = _engine(llama[0], device="cuda", cuda_graph_max_bs=8)
    sp = dict(temperature=0.6, top_p=0.9, ignore_eos=True)
    assert engine.warm_up_sampling(SamplingParams(**sp)) > 0
    before = set(engine.runner.decode_graphs.graphs)
    params = [SamplingParams(max_tokens=m, **sp) for m in MAX_TOKENS]
    outs = run_staggered(engine, PROMPTS, params, arrive_at=(4, 9))
    assert [len(t) for t in outs] == MAX_TOKENS
    assert set(engine.runner.decode_graphs.graphs) == before
