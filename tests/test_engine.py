"""Engine contracts against transformers' reference models (greedy `generate` on the same
seeded tiny checkpoints): batching, chunked prefill, mid-flight arrivals, SWA windows, prefix
cache hits, preemption under a tiny KV budget, abort, stop conditions and logprobs."""

import random

import pytest
import torch
from engine_helpers import save_engine_checkpoint

from torch_runner import Engine, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(20, 51)), [100] * 11, list(range(200, 219)), [42]]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for model_type in ("llama", "gpt_oss"):  # full attention only / SWA + full mixed (window 8)
        path, hf = save_engine_checkpoint(
            model_type, tmp_path_factory.mktemp(model_type), initializer_range=0.5
        )
        out[model_type] = (str(path), hf)
    return out


def _reference(hf, prompt, max_tokens):
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def _engine(path, **kwargs):
    defaults = dict(device="cpu", max_total_tokens=2048, block_size=4, chunked_prefill_size=16)
    return Engine(path, **{**defaults, **kwargs})


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss"])
@pytest.mark.parametrize("chunked_prefill_size", [8, 0])
def test_batched_greedy_equals_reference_with_midflight_arrivals(
    checkpoints, model_type, chunked_prefill_size
):
    path, hf = checkpoints[model_type]
    engine = _engine(path, chunked_prefill_size=chunked_prefill_size, max_num_seqs=4)
    params = SamplingParams(max_tokens=14, **GREEDY)
    rids = [engine.add_request(None, p, params) for p in PROMPTS[:2]]
    final, step = {}, 0
    while engine.has_unfinished() or len(rids) < len(PROMPTS):
        if step in (2, 5, 6) and len(rids) < len(PROMPTS):  # arrivals while others decode
            rids.append(engine.add_request(None, PROMPTS[len(rids)], params))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
    for rid, prompt in zip(rids, PROMPTS):
        assert final[rid].token_ids == _reference(hf, prompt, 14), (rid, prompt)
        assert final[rid].finish_reason == "length"
    if model_type == "gpt_oss":  # SWA layers never took pool memory beyond their window
        assert engine.args.sliding_window == 8
        assert engine.runner.swa_caches == {}  # freed at finish
        assert engine.runner.layout.swa_layers == (0, 2)


def test_swa_window_buffers_stay_bounded_during_decode(checkpoints):
    path, hf = checkpoints["gpt_oss"]
    engine = _engine(path, chunked_prefill_size=16)
    prompt = list(range(30, 60))
    stream = engine.stream(prompt, SamplingParams(max_tokens=40, **GREEDY))
    tokens = []
    for out in stream:
        caches = engine.runner.swa_caches.get(out.request_id, [])
        for cache in caches:
            assert cache.capacity <= cache.window + max(16, cache.window)
        tokens = out.token_ids
    assert tokens == _reference(hf, prompt, 40)


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss"])
def test_prefix_cache_hits_equal_cold_runs(checkpoints, model_type):
    path, hf = checkpoints[model_type]
    shared = list(range(60, 90))  # 30 tokens: 7 full blocks of 4
    prompts = [shared + [1, 2, 3], shared + [9], shared[:17] + [4, 4]]
    params = SamplingParams(max_tokens=10, **GREEDY)
    cold = _engine(path, enable_prefix_caching=False).generate(prompts, params)
    engine = _engine(path)
    first = engine.generate(prompts[:1], params)[0]
    warm = engine.generate(prompts[1:], params)
    assert first.num_cached_tokens == 0
    assert warm[0].num_cached_tokens >= 16 and warm[1].num_cached_tokens >= 12
    for out, ref, prompt in zip([first, *warm], cold, prompts):
        assert out.token_ids == ref.token_ids == _reference(hf, prompt, 10)
    assert engine.stats()["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss"])
def test_a_pool_full_of_cached_prefixes_evicts_and_still_equals_cold_runs(
    checkpoints, model_type, monkeypatch
):
    """A long-running server's steady state: waves of requests over three shared system
    prompts fill a 64-block pool with cached prefixes, so later waves evict while they hit;
    every output equals the engine without a prefix cache."""
    path, _ = checkpoints[model_type]
    rng = random.Random(5)
    systems = [[rng.randrange(50, 200) for _ in range(n)] for n in (17, 22, 26)]
    waves = [
        [rng.choice(systems) + [rng.randrange(50, 200) for _ in range(rng.randint(2, 9))]
         for _ in range(6)]
        for _ in range(5)
    ]  # fmt: skip
    params = SamplingParams(max_tokens=12, **GREEDY)
    config = dict(max_total_tokens=256, max_num_seqs=6)
    cold = _engine(path, enable_prefix_caching=False, **config)
    engine = _engine(path, **config)
    freed = []
    evict = type(engine.prefix_cache).evict
    monkeypatch.setattr(
        engine.prefix_cache,
        "evict",
        lambda n: freed.append(evict(engine.prefix_cache, n)) or freed[-1],
    )
    hits = 0
    for wave in waves:
        outs = engine.generate(wave, params)
        for out, ref in zip(outs, cold.generate(wave, params)):
            assert out.token_ids == ref.token_ids
        hits += sum(o.num_cached_tokens > 0 for o in outs)
        bm = engine.block_manager
        assert bm.num_free_blocks + engine.prefix_cache.num_evictable_blocks() == bm.num_blocks
    assert sum(freed) > 0 and hits >= 12


def test_paged_windows_reuse_prefixes_at_any_block_boundary(checkpoints):
    """swa_kv='paged' (the CUDA default): SWA layers live in the pool, so a gpt-oss prefix is
    reused at every block boundary (windowed caches: only where a window snapshot exists) and
    a second chat turn prefills only its new tokens; outputs equal transformers'."""
    path, hf = checkpoints["gpt_oss"]
    shared = list(range(60, 90))  # 30 tokens: 7 full blocks of 4, not a chunk end (16)
    prompts = [shared + [1, 2, 3], shared + [9], shared[:17] + [4, 4]]
    params = SamplingParams(max_tokens=10, **GREEDY)
    engine = _engine(path, swa_kv="paged")
    assert engine.runner.layout.swa_layers == () and engine.runner.swa_caches == {}
    first = engine.generate(prompts[:1], params)[0]
    warm = engine.generate(prompts[1:], params)
    assert [w.num_cached_tokens for w in warm] == [28, 16]
    turn2 = prompts[0] + first.token_ids + [7, 7]  # the previous turn, then the user's reply
    second = engine.generate([turn2], params)[0]
    assert second.num_cached_tokens == 40  # 42 tokens had KV: 10 whole blocks
    for out, prompt in zip([first, *warm, second], [*prompts, turn2]):
        assert out.token_ids == _reference(hf, prompt, 10)


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss"])
def test_tiny_kv_budget_preempts_and_all_requests_finish_correctly(checkpoints, model_type):
    path, hf = checkpoints[model_type]
    engine = _engine(path, max_total_tokens=64, max_num_seqs=6, chunked_prefill_size=16)
    prompts = [list(range(10 + i, 30 + i)) for i in range(5)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    assert engine.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == _reference(hf, prompt, 24)


def test_abort_returns_the_pool_to_its_initial_free_count(checkpoints):
    path, _ = checkpoints["gpt_oss"]
    engine = _engine(path)
    initial = engine.block_manager.num_free_blocks
    rids = [engine.add_request(None, p, SamplingParams(max_tokens=50, **GREEDY)) for p in PROMPTS]
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < initial
    for rid in rids:
        out = engine.abort(rid)
        assert out.finished and out.finish_reason == "abort"
    assert not engine.has_unfinished() and engine.runner.swa_caches == {}
    assert (
        engine.block_manager.num_free_blocks + engine.prefix_cache.num_evictable_blocks() == initial
    )
    engine.reset_prefix_cache()
    assert engine.block_manager.num_free_blocks == initial


def test_stop_strings_are_cut_and_never_streamed(checkpoints):
    path, hf = checkpoints["llama"]
    engine = _engine(path)
    prompt = [5, 6, 7]
    full = engine.generate([prompt], SamplingParams(max_tokens=20, **GREEDY))[0]
    ref_ids = _reference(hf, prompt, 20)
    assert full.token_ids == ref_ids
    text = engine.tokenizer.decode(ref_ids)
    assert full.text == text
    start = next(
        i
        for i in range(3, len(text) - 2)
        if "\ufffd" not in text[i : i + 2] and text.index(text[i : i + 2]) == i
    )
    stop = text[start : start + 2]
    cut = text[:start]
    params = SamplingParams(max_tokens=20, stop=[stop], **GREEDY)
    streamed, seen = "", []
    for out in engine.stream(prompt, params):
        streamed += out.delta_text
        seen.append(out.text)
        assert stop not in out.text
    assert streamed == cut == out.text and out.finish_reason == "stop" and out.stop_reason == stop
    token = ref_ids[4]
    out = engine.generate(
        [prompt], SamplingParams(max_tokens=20, stop_token_ids=[token], **GREEDY)
    )[0]
    assert out.token_ids == ref_ids[: ref_ids.index(token) + 1] and out.stop_reason == token


def test_eos_and_context_length_end_generation(checkpoints):
    path, hf = checkpoints["llama"]
    prompt = [5, 6, 7]
    ref_ids = _reference(hf, prompt, 20)
    engine = _engine(path, max_model_len=10)
    out = engine.generate([prompt], SamplingParams(max_tokens=20, **GREEDY))[0]
    assert out.token_ids == ref_ids[:7] and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len is 10"):
        engine.generate([list(range(10))], SamplingParams())
    engine = _engine(path)
    engine.eos_token_ids = {ref_ids[3]}
    engine.runner.eos_token_ids = [ref_ids[3]]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20))[0]
    first = ref_ids.index(ref_ids[3])
    assert (
        out.token_ids == ref_ids[: first + 1]
        and out.finish_reason == "stop"
        and out.stop_reason is None
    )


def test_logprobs_match_reference_log_softmax(checkpoints):
    path, hf = checkpoints["llama"]
    engine = _engine(path)
    prompt = list(range(20, 31))
    out = engine.generate(
        [prompt], SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    )[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].double(), dim=-1)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(3)
        assert [t for t, _ in entry.top_logprobs] == top.indices.tolist()


def test_deterministic_sampling_ignores_batchmates(checkpoints):
    path, _ = checkpoints["llama"]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = _engine(path, enable_deterministic_inference=True).generate([[5, 6, 7]], params)[0]
    batch = _engine(path, enable_deterministic_inference=True).generate(
        [[9, 9], [5, 6, 7], [1, 2, 3, 4]], params
    )
    assert batch[1].token_ids == alone.token_ids
    seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    a, b = _engine(path).generate([[5, 6, 7], [5, 6, 7]], [seeded, seeded])
    assert a.token_ids == b.token_ids
    n2 = _engine(path).generate(
        [[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=12, seed=7, n=2)
    )
    assert len(n2) == 2 and n2[0].token_ids == a.token_ids != n2[1].token_ids


def test_bad_requests_name_the_field(checkpoints):
    path, _ = checkpoints["llama"]
    engine = _engine(path)
    with pytest.raises(ValueError, match="out of range"):
        engine.generate([[300]], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        _engine(path, chunked_prefill_size=2)
    with pytest.raises(ValueError, match="dtype"):
        _engine(path, dtype="int8")


def test_a_request_longer_than_the_pool_stops_at_the_pool_size(checkpoints):
    path, hf = checkpoints["llama"]
    engine = _engine(path, max_total_tokens=32)  # 8 blocks of 4: smaller than max_model_len
    assert engine.max_model_len == 32
    prompt = [5, 6, 7]
    out = engine.generate([prompt], SamplingParams(max_tokens=100, **GREEDY))[0]
    assert out.finish_reason == "length" and out.token_ids == _reference(hf, prompt, 29)
