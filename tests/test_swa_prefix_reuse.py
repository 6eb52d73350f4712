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
    return Engine(path, device="cpu", max_total_tokens=1024, block_size=BS,
                  chunked_prefill_size=chunk, **kwargs)  # fmt: skip


def _logprobs(out):
    return [lp.logprob for lp in out.logprobs]


def _assert_same(warm, cold, hf, prompt):
    assert warm.token_ids == cold.token_ids == hf_greedy(hf, prompt, PARAMS.max_tokens)
    # fp32: KV computed in other chunk shapes (decode, a restored window) rounds differently,
    # up to 4.9e-5 here and as much with swa_kv="paged" (the pool's own KV, no window copies);
    # a window off by one token moves them by more than 1e-2
    assert _logprobs(warm) == pytest.approx(_logprobs(cold), abs=1e-4)


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
