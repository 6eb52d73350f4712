"""Prefix reuse on sliding-window models with per-request windows (swa_kv="windowed", the CPU
default) at any block boundary: a shared system prompt shorter than a prefill chunk, and the
previous turns of a chat (prompt and generated tokens), are served from the cache; greedy
tokens and logprobs equal a cold engine's (prefix caching off) and transformers' tokens.

Tiny seeded checkpoints (tests/tiny_models.py): gpt-oss (SWA + sinks, alternating with full
layers), Gemma 3 (5 local : 1 global pattern) and Mistral (every layer windowed), window 8.
"""

import pytest
from engine_helpers import hf_greedy, save_engine_checkpoint

from torch_runner import Engine, SamplingParams
from torch_runner.kv.block_manager import NO_BLOCK

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 4
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
SYSTEM = [(7 * i + 3) % 200 + 20 for i in range(22)]  # 22 tokens: 5 whole blocks, not a chunk end
FAMILIES = ("gpt_oss", "gemma3_text", "mistral")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for model_type in FAMILIES:
        path, hf = save_engine_checkpoint(
            model_type, tmp_path_factory.mktemp(model_type), initializer_range=0.5
        )
        out[model_type] = (str(path), hf)
    return out


def _engine(path, chunk, **kwargs):
    defaults = dict(device="cpu", max_total_tokens=1024, block_size=BS, chunked_prefill_size=chunk)
    return Engine(path, **{**defaults, **kwargs})


def _logprobs(out):
    return [lp.logprob for lp in out.logprobs]


def _assert_same(warm, cold, hf, prompt):
    assert warm.token_ids == cold.token_ids == hf_greedy(hf, prompt, len(cold.token_ids))
    # fp32: KV computed in other chunk shapes (decode, a restored window) rounds differently,
    # up to 4.9e-5 here and as much with swa_kv="paged" (the pool's own KV, no window copies);
    # a window off by one token moves them by more than 1e-2. With the native CPU kernels
    # (ops/cpu_native) a warm suffix of <= 8 rows runs the native GEMV where the cold prompt
    # runs MKL: up to 1.3e-4 apart
    assert _logprobs(warm) == pytest.approx(_logprobs(cold), abs=3e-4)


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("chunk", [32, 16, 0])
def test_shared_system_prompt_shorter_than_a_chunk_is_reused(checkpoints, model_type, chunk):
    path, hf = checkpoints[model_type]
    engine = _engine(path, chunk)
    assert engine.runner.layout.has_swa  # the windowed path, not the paged one
    prompts = [SYSTEM + [5, 6, 7, 8, 9, 10, 11, 12, 13], SYSTEM + [90, 91, 92]]
    first = engine.generate(prompts[0], PARAMS)[0]
    second = engine.generate(prompts[1], PARAMS)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(SYSTEM) // BS) * BS  # 20: every shared whole block
    cold = _engine(path, chunk, enable_prefix_caching=False)
    for out, prompt in zip([first, second], prompts):
        _assert_same(out, cold.generate(prompt, PARAMS)[0], hf, prompt)


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("chunk", [16, 0])
def test_second_chat_turn_prefills_only_its_new_tokens(checkpoints, model_type, chunk):
    path, hf = checkpoints[model_type]
    engine = _engine(path, chunk)
    cold = _engine(path, chunk, enable_prefix_caching=False)
    turn = SYSTEM + [5, 6, 7]
    for _ in range(3):  # three turns: each one's prompt is the whole conversation so far
        out = engine.generate(turn, PARAMS)[0]
        _assert_same(out, cold.generate(turn, PARAMS)[0], hf, turn)
        # every token but the last generated one has KV: its whole blocks are reused
        previous = len(turn) + len(out.token_ids) - 1
        turn = turn + out.token_ids + [30, 31, 32]
        if previous // BS:
            nxt = engine.generate(turn, SamplingParams(max_tokens=1, temperature=0.0))[0]
            assert nxt.num_cached_tokens == (previous // BS) * BS


@pytest.mark.parametrize("model_type", ["gpt_oss", "mistral"])
def test_concurrent_requests_and_a_tight_payload_cap_stay_exact(checkpoints, model_type):
    """Requests sharing a prefix run side by side (one publishes while the other prefills), and
    with room for one window of payloads the matches fall back to covered ancestors: outputs
    stay the cold engine's."""
    path, hf = checkpoints[model_type]
    prompts = [SYSTEM + [i, i + 1, i + 2] for i in (40, 50, 60, 70)]
    cold = _engine(path, 8, enable_prefix_caching=False).generate(prompts, PARAMS)
    for cap in (64, 1, 0):
        engine = _engine(path, 8, max_num_seqs=2, max_cached_windows=cap)
        warm = engine.generate(prompts, PARAMS)
        for w, c, prompt in zip(warm, cold, prompts):
            assert w.token_ids == c.token_ids == hf_greedy(hf, prompt, PARAMS.max_tokens)
            assert _logprobs(w) == pytest.approx(_logprobs(c), abs=1e-4)
        assert engine.prefix_cache.num_payloads <= cap * 2  # 2 payload nodes per window of 8
        if cap == 0:
            assert all(w.num_cached_tokens == 0 for w in warm)
        if cap == 64:
            assert warm[2].num_cached_tokens == 20 and warm[3].num_cached_tokens == 20


def test_window_shorter_than_a_block_is_reused_at_block_boundaries(checkpoints):
    """block_size 16 > window 8: a payload holds only its block's last 8 tokens."""
    path, hf = checkpoints["gpt_oss"]
    engine = Engine(path, device="cpu", max_total_tokens=1024, block_size=16,
                    chunked_prefill_size=0)  # fmt: skip
    cold = Engine(path, device="cpu", max_total_tokens=1024, block_size=16,
                  chunked_prefill_size=0, enable_prefix_caching=False)  # fmt: skip
    long_system = SYSTEM + SYSTEM[:13]  # 35 tokens: 2 whole blocks of 16
    prompts = [long_system + [5, 6], long_system + [9]]
    outs = [engine.generate(p, PARAMS)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 32]
    for out, prompt in zip(outs, prompts):
        _assert_same(out, cold.generate(prompt, PARAMS)[0], hf, prompt)


# ---- swa_kv="paged": every layer windowed (Mistral) gives back blocks behind the window -------


def _paged(path, **kwargs):
    return _engine(path, kwargs.pop("chunk", 16), swa_kv="paged", **kwargs)


def _live_blocks(table):
    return sum(b != NO_BLOCK for b in table)


@pytest.mark.parametrize("caching", [True, False])
def test_paged_all_window_model_frees_blocks_behind_the_window(checkpoints, caching):
    path, hf = checkpoints["mistral"]
    engine = _paged(path, enable_prefix_caching=caching)
    assert engine.runner.layout.frees_behind_window and not engine.runner.layout.has_swa
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=True)
    prompt = SYSTEM + [5, 6, 7]
    rid = engine.add_request(None, prompt, params)
    seq, most, out = engine.scheduler.find(rid), 0, None
    while engine.has_unfinished():
        outputs = engine.step()
        out = outputs[-1] if outputs else out
        if not seq.is_finished and seq.num_computed_tokens >= len(prompt):  # decoding
            # (admission takes the whole prompt's blocks at once; prefill gives them back)
            most = max(most, _live_blocks(seq.block_table))
            if not caching:  # nothing else holds a block: the pool holds only the window
                assert engine.block_manager.num_used_blocks == _live_blocks(seq.block_table)
    # window 8: two blocks, plus the one being filled and the next; with prefix caching the
    # prompt's blocks (published, so the cache holds them too) stay with the request
    pinned = len(prompt) // BS if caching else 0
    assert most <= pinned + 8 // BS + 2
    assert -(-(len(prompt) + 60) // BS) >= 2 * most  # of a sequence 22 blocks long
    cold = _engine(path, 16, enable_prefix_caching=False)  # windowed caches: another path
    _assert_same(out, cold.generate(prompt, params)[0], hf, prompt)


def test_paged_chat_reuses_the_conversation_across_freed_blocks(checkpoints):
    """Turn 2 matches the whole previous conversation although its middle blocks were given
    back (hole nodes): only the window before the match end must be held. A prompt that
    diverges inside the holes falls back to the deepest node whose window is held."""
    path, hf = checkpoints["mistral"]
    engine = _paged(path)
    cold = _engine(path, 16, enable_prefix_caching=False)
    long_params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=True)
    turn1 = SYSTEM + [5, 6, 7]
    first = engine.generate(turn1, long_params)[0]
    turn2 = turn1 + first.token_ids + [30, 31, 32]
    second = engine.generate(turn2, PARAMS)[0]
    assert second.num_cached_tokens == ((len(turn1) + 30 - 1) // BS) * BS
    _assert_same(second, cold.generate(turn2, PARAMS)[0], hf, turn2)
    forked = turn1 + first.token_ids[:14] + [77, 78]  # diverges where turn 1's blocks are holes
    third = engine.generate(forked, PARAMS)[0]
    assert 0 < third.num_cached_tokens < len(forked)
    _assert_same(third, cold.generate(forked, PARAMS)[0], hf, forked)


def test_paged_tiny_pool_with_freed_blocks_finishes_every_request(checkpoints):
    path, hf = checkpoints["mistral"]
    engine = _paged(path, max_total_tokens=64, max_num_seqs=6)
    prompts = [list(range(10 + i, 30 + i)) for i in range(5)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == hf_greedy(hf, prompt, 24)


def test_paged_model_with_full_layers_frees_nothing(checkpoints):
    path, _ = checkpoints["gpt_oss"]
    engine = _paged(path)
    assert not engine.runner.layout.frees_behind_window
    rid = engine.add_request(None, SYSTEM, SamplingParams(max_tokens=20, temperature=0.0))
    seq = engine.scheduler.find(rid)
    while engine.has_unfinished():
        engine.step()
        assert NO_BLOCK not in seq.block_table


def test_static_decode_reads_tables_with_holes(checkpoints):
    """The CUDA-graph decode (its static forward, run eagerly on CPU) reads the pool through
    the block table with the paged decode op: with the blocks behind the window given back
    its tokens stay transformers'."""
    from torch_runner.runner.cuda_graphs import DecodeGraphs

    path, hf = checkpoints["mistral"]
    engine = _paged(path, enable_prefix_caching=False)
    r = engine.runner
    r.decode_graphs = DecodeGraphs(r.model, r.pool, r.full_layers, len(r.args.layer_types),
                                   r.device, 8, capture=False, min_keys=8)  # fmt: skip
    prompts = [SYSTEM + [5, 6, 7], SYSTEM[:9]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(None, p, params) for p in prompts]
    seqs = [engine.scheduler.find(rid) for rid in rids]
    final, holes = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
        holes = max(holes, min(s.block_table.count(NO_BLOCK) for s in seqs))
    assert holes >= 5  # both rows decoded with several blocks given back
    for rid, prompt in zip(rids, prompts):
        assert final[rid] == hf_greedy(hf, prompt, 40)
