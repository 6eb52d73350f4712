"""Incremental detokenizer and stop-string helpers against the tokenizer's own full decode."""

import random

import pytest
from engine_helpers import byte_tokenizer

from torch_runner.detokenizer import (
    IncrementalDetokenizer,
    StopStrings,
    find_stop,
    holdback_length,
)

TEXT = "naïve café — 東京タワー 🚀🎉 done, ok? «quoted» ελληνικά"


def _stream(tokenizer, prompt_ids, ids):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.append(t) for t in ids]
    return detok, deltas


def test_byte_tokens_never_split_a_character():
    tok = byte_tokenizer()  # one token per byte: every non-ASCII character spans 2-4 tokens
    ids = tok(TEXT).input_ids
    assert len(ids) > len(TEXT)
    detok, deltas = _stream(tok, tok("prompt: ").input_ids, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids) == TEXT
    assert any(d == "" for d in deltas)  # held back mid-character


def test_flush_emits_an_incomplete_tail_at_the_end():
    tok = byte_tokenizer()
    ids = tok("ok 🚀").input_ids[:-1]  # cut inside the emoji
    detok, deltas = _stream(tok, [], ids)
    assert "".join(deltas) == "ok "
    detok.flush()
    assert detok.text == tok.decode(ids)


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    from models.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def test_bpe_tokenizer_deltas_equal_full_decode(smollm_tokenizer):
    tok = smollm_tokenizer
    rng = random.Random(0)
    prompt = tok("Translate: ").input_ids
    ids = tok(TEXT + " The quick brown fox.").input_ids
    detok, deltas = _stream(tok, prompt, ids)
    assert "".join(deltas) == tok.decode(ids) and all("\ufffd" not in d for d in deltas)
    # random ids (arbitrary byte fragments, long enough to trim the window) still decode whole
    ids = [rng.randrange(tok.vocab_size) for _ in range(300)]
    detok, deltas = _stream(tok, prompt, ids)
    detok.flush()
    assert detok.text == tok.decode(ids, skip_special_tokens=True)


def test_find_stop_and_holdback():
    assert find_stop("abc STOP def", ["STOP", "def"], 0) == (4, "STOP")
    assert find_stop("abc", ["x"], 0) is None
    assert find_stop("ab ab", ["ab"], 1) == (3, "ab")
    assert holdback_length("hello ST", ["STOP"]) == 2
    assert holdback_length("hello S", ["STOP", "Sx"]) == 1
    assert holdback_length("hello", ["STOP"]) == 0
    assert holdback_length("xSTO", ["STOP", "TOPS"]) == 3


def test_stop_strings_index_equals_the_brute_force_holdback():
    rng = random.Random(3)
    alphabet = "ab\n é"  # few characters: prefixes overlap and repeat ("aab", "\n\n\n")
    for _ in range(400):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 6)))
                 for _ in range(rng.randrange(1, 4))]  # fmt: skip
        matcher = StopStrings(stops)
        assert matcher.max_len == max(map(len, stops))
        for _ in range(20):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
            assert matcher.holdback(text) == holdback_length(text, stops), (text, stops)
            start = rng.randrange(-3, 12)
            assert matcher.find(text, start) == find_stop(text, stops, start)
