"""Overlapped scheduling (engine_step.py, `async_scheduling=True`) against the synchronous
engine as the oracle: the same workloads, run both ways on the same seeded tiny checkpoints,
give the same tokens, logprobs and finish reasons (greedy and seeded sampling, stop strings,
EOS, max_tokens, min_tokens, aborts, preemption, chunked prefill beside decodes, prefix hits);
chained steps really ran (placeholder inputs read on the device); and a step whose next one
needs its token on the host (grammar, penalties) is never chained. Greedy outputs are also
checked against transformers."""

import pytest
import torch
from engine_helpers import hf_greedy, save_engine_checkpoint

from ops.sampling.params import StructuredOutputSpec
from torch_runner import Engine, SamplingParams
from torch_runner.engine_step import is_chain_safe

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7], list(range(20, 51)), [100] * 11, list(range(200, 219)), [42]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for model_type in ("llama", "gpt_oss"):  # full attention / SWA (window 8) + full mixed
        path, hf = save_engine_checkpoint(
            model_type, tmp_path_factory.mktemp(model_type), initializer_range=0.5
        )
        out[model_type] = (str(path), hf)
    return out


def _engine(path, overlap: bool, **kwargs):
    defaults = dict(device="cpu", max_total_tokens=2048, block_size=4, chunked_prefill_size=8)
    engine = Engine(path, async_scheduling=overlap, **{**defaults, **kwargs})
    engine.chained = []  # per launch: how many chunks read a placeholder input
    engine.unsafe = []  # per launch: does it sample a non-chain-safe request
    launch = engine.runner.launch

    def spy(chunks, grammar_rows=None):
        engine.chained.append(sum(c.is_chained for c in chunks))
        engine.unsafe.append(any(c.is_sampled and not is_chain_safe(c.seq) for c in chunks))
        return launch(chunks, grammar_rows)

    engine.runner.launch = spy
    return engine


def _summary(outputs):
    return [
        (o.token_ids, o.finish_reason, o.stop_reason, o.text, o.logprobs, o.error) for o in outputs
    ]


def _both(path, run, **kwargs):
    """run(engine) on a synchronous and an overlapped engine; returns both results and the
    overlapped engine."""
    sync = run(_engine(path, False, **kwargs))
    engine = _engine(path, True, **kwargs)
    return sync, run(engine), engine


def _staggered(prompts, params, arrive_at=()):
    def run(engine):
        final = {}
        rids, step, upfront = [], 0, len(prompts) - len(arrive_at)
        while len(rids) < len(prompts) or engine.has_unfinished():
            if len(rids) < len(prompts) and (len(rids) < upfront or step in arrive_at):
                rids.append(engine.add_request(None, prompts[len(rids)], params[len(rids)]))
                continue
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            step += 1
        return _summary(final[r] for r in rids)

    return run


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss"])
def test_greedy_with_logprobs_and_midflight_arrivals_equals_sync(checkpoints, model_type):
    path, hf = checkpoints[model_type]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=9 + i, logprobs=True,
                             top_logprobs=2) for i in range(len(PROMPTS))]  # fmt: skip
    sync, overlapped, engine = _both(
        path, _staggered(PROMPTS, params, arrive_at=(2, 5, 6)), max_num_seqs=4
    )
    assert overlapped == sync
    assert sum(engine.chained) > 20  # decodes and first tokens after prefill were chained
    for (tokens, reason, *_), prompt, p in zip(overlapped, PROMPTS, params):
        assert tokens == hf_greedy(hf, prompt, p.max_tokens) and reason == "length"
    assert engine.runner.swa_caches == {} and not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == engine.prefix_cache.num_evictable_blocks()


def test_seeded_sampling_equals_sync(checkpoints):
    path, _ = checkpoints["llama"]
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=7 + i, max_tokens=12,
                       logprobs=True, ignore_eos=True) for i in range(4)
    ] + [SamplingParams(temperature=1.3, seed=99, max_tokens=10, min_tokens=6)]  # fmt: skip
    sync, overlapped, engine = _both(path, _staggered(PROMPTS, params, arrive_at=(3,)))
    assert overlapped == sync
    assert sum(engine.chained) > 0


def test_stop_strings_eos_and_stop_tokens_equal_sync(checkpoints):
    """Requests that end on a token only known after the step (a wasted chained slot each)."""
    path, _ = checkpoints["llama"]
    free = _engine(path, False).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12,
                                                                 ignore_eos=True))  # fmt: skip
    params = []
    for i, out in enumerate(free):  # stop on what the free run produced at step 3-6
        cut = 3 + i % 4
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, stop=[out.text[cut : cut + 2]]))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.0, stop_token_ids=[out.token_ids[cut]]))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=12))
    params[-1] = SamplingParams(
        temperature=0.0, stop=["\x00never"], include_stop_str_in_output=True
    )

    def run(engine):
        engine.eos_token_ids.add(free[2].token_ids[4])  # request 2 ends on "EOS"
        return _summary(engine.generate(PROMPTS, params))

    sync, overlapped, engine = _both(path, run)
    assert overlapped == sync
    assert [s[1] for s in sync].count("stop") >= 3
    assert engine.block_manager.num_used_blocks == engine.prefix_cache.num_evictable_blocks()


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss"])
def test_preemption_under_a_tiny_pool_equals_sync(checkpoints, model_type):
    path, hf = checkpoints[model_type]
    prompts = [list(range(10 + i, 30 + i)) for i in range(5)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
    sync, overlapped, engine = _both(
        path,
        lambda e: _summary(e.generate(prompts, params)),
        max_total_tokens=64,
        max_num_seqs=6,
        chunked_prefill_size=16,
    )
    assert engine.scheduler.num_preemptions > 0
    assert overlapped == sync
    for (tokens, *_), prompt in zip(overlapped, prompts):
        assert tokens == hf_greedy(hf, prompt, 24)


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss"])
def test_prefix_hits_equal_sync(checkpoints, model_type):
    path, _ = checkpoints[model_type]
    shared = list(range(60, 90))
    prompts = [shared + [1, 2, 3], shared + [9], shared[:17] + [4, 4]]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10)

    def run(engine):
        first = engine.generate(prompts[:1], params)
        warm = engine.generate(prompts[1:], params)
        assert warm[0].num_cached_tokens >= 16
        # a second chat turn: the previous turn's decode blocks (published a chunk late when
        # chained) are hit too
        turn2 = engine.generate([prompts[0] + first[0].token_ids + [7, 7]], params)
        assert turn2[0].num_cached_tokens >= 36
        outs = first + warm + turn2
        return _summary(outs), [o.num_cached_tokens for o in outs]

    sync, overlapped, _ = _both(path, run)
    assert overlapped == sync


def test_aborts_mid_flight_equal_sync_and_free_the_pool(checkpoints):
    path, _ = checkpoints["gpt_oss"]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30)

    def run(engine):
        initial = engine.block_manager.num_free_blocks
        rids = [engine.add_request(None, p, params) for p in PROMPTS]
        final = {}
        for step in range(40):
            if step == 4:
                engine.abort(rids[1])
            if step == 7:
                engine.abort(rids[3])
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        assert not engine.has_unfinished()
        engine.reset_prefix_cache()
        assert engine.block_manager.num_free_blocks == initial
        return _summary(final[r] for r in (rids[0], rids[2], rids[4]))

    sync, overlapped, _ = _both(path, run)
    assert overlapped == sync


def test_penalty_and_grammar_steps_are_not_chained(checkpoints):
    """chain_safe: a penalty row reads its outputs on the host, a grammar row needs the token
    to advance its matcher, so no step after one holding them is chained; plain batches are."""
    path, _ = checkpoints["llama"]
    plain = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
    penalised = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8,
                               repetition_penalty=1.5, presence_penalty=0.5)  # fmt: skip
    grammar = SamplingParams(temperature=0.0, max_tokens=20,
                             structured=StructuredOutputSpec("regex", r"[a-z]{3,8}@x\.com"))  # fmt: skip
    for params in ([penalised, plain], [plain, grammar]):
        prompts = PROMPTS[: len(params)]
        sync, overlapped, engine = _both(
            path, lambda e, pr=prompts, ps=params: _summary(e.generate(pr, ps))
        )
        assert overlapped == sync
        assert any(engine.unsafe)
        after_unsafe = [n for n, unsafe in zip(engine.chained[1:], engine.unsafe) if unsafe]
        assert after_unsafe and sum(after_unsafe) == 0, (engine.chained, engine.unsafe)
    _, _, engine = _both(path, lambda e: e.generate(PROMPTS[:2], plain))
    assert sum(engine.chained) > 0


def test_async_scheduling_is_validated(checkpoints):
    path, _ = checkpoints["llama"]
    with pytest.raises(ValueError, match="async_scheduling"):
        Engine(path, device="cpu", async_scheduling="yes")
    with pytest.raises(ValueError, match="async_scheduling=True is invalid with tensor_para"):
        Engine(path, device="cpu", async_scheduling=True, tensor_parallel_size=2)
    assert not Engine(path, device="cpu", max_total_tokens=256).is_overlapped  # auto: CPU off


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["llama", "gpt_oss"])
def test_cuda_graphs_overlapped_equal_sync(checkpoints, model_type):
    """On CUDA (graphs replay the decode, chained rows resolved in the graph's input buffer):
    greedy and seeded outputs of the overlapped engine equal the synchronous one's."""
    path, _ = checkpoints[model_type]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12 + i, logprobs=True)
              for i in range(3)]  # fmt: skip
    params += [SamplingParams(temperature=0.8, top_p=0.9, seed=5 + i, max_tokens=10,
                              ignore_eos=True) for i in range(2)]  # fmt: skip
    sync, overlapped, engine = _both(
        path, _staggered(PROMPTS, params, arrive_at=(3,)), device="cuda", cuda_graph_max_bs=8
    )
    assert engine.is_overlapped and sum(engine.runner.decode_graphs.head_steps.values())
    assert sum(engine.chained) > 20
    assert [o[:4] for o in overlapped] == [s[:4] for s in sync]
    for o, s in zip(overlapped, sync):
        if o[4] is not None:
            assert [x.logprob for x in o[4]] == pytest.approx([x.logprob for x in s[4]], abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_overlapped_decode_steps_never_sync_the_stream(checkpoints, temperature):
    """Steady-state decode (greedy, then seeded sampling): torch's sync debug mode sees no
    blocking host-device call in a step (the tokens come back by an event, not a sync)."""
    import warnings

    path, _ = checkpoints["llama"]
    engine = _engine(path, True, device="cuda", cuda_graph_max_bs=8)
    params = SamplingParams(temperature=temperature, seed=3, ignore_eos=True, max_tokens=60)
    for prompt in PROMPTS[:4]:
        engine.add_request(None, prompt, params)
    for _ in range(12):  # prefill, graph capture
        engine.step()
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
    assert all(engine.chained[-10:])


def test_async_engine_streams_an_overlapped_engine_like_the_sync_one(checkpoints):
    """The server's background loop over an overlapped engine: every stream ends with the
    synchronous engine's tokens, and the deltas add up to them."""
    import asyncio

    from torch_runner.async_engine import AsyncEngine

    path, _ = checkpoints["llama"]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6 + 3 * i)
              for i in range(len(PROMPTS))]  # fmt: skip
    sync = _engine(path, False).generate(PROMPTS, params)
    server = AsyncEngine(_engine(path, True))
    server.start()

    async def one(i):
        outs = [o async for o in server.generate(f"r{i}", PROMPTS[i], params[i])]
        return outs[-1].token_ids, [t for o in outs for t in o.delta_token_ids]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    try:
        streamed = asyncio.run(main())
    finally:
        server.shutdown()
    assert [s[0] for s in streamed] == [o.token_ids for o in sync]
    assert [s[1] for s in streamed] == [o.token_ids for o in sync]
    assert sum(server.engine.chained) > 0


def test_a_non_finite_row_ends_only_its_request_when_chained(checkpoints):
    """NaN logits (injected in the embedding, as test_reliability_nonfinite does) end that
    request with an error; its chained slot reads a valid id, so batchmates go on unchanged."""
    path, _ = checkpoints["llama"]
    prompts = [[5, 6, 7, 8], [1, 2, 77, 3], list(range(20, 41))]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, logprobs=True)

    def run(engine):
        def hook(module, inputs, output):
            return output.masked_fill((inputs[0] == 77)[..., None], float("nan"))

        handle = engine.runner.model.model.embed_tokens.register_forward_hook(hook)
        try:
            return _summary(engine.generate(prompts, params))
        finally:
            handle.remove()

    sync, overlapped, engine = _both(path, run, enable_prefix_caching=False)
    assert overlapped == sync
    assert overlapped[1][1] == "error" and overlapped[1][0] == []
    assert engine.block_manager.num_used_blocks == 0 and engine.num_non_finite == 1
