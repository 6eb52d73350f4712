"""The byte-table detokenizer path against the tokenizer's own decode (the windowed reference).

Oracles: the Rust backend's `decode` of every id and of random id runs, and the same
`IncrementalDetokenizer` decoding its windows through the tokenizer (`use_byte_table=False`).
"""

import random

import pytest
from engine_helpers import byte_tokenizer

from torch_runner.detokenizer import IncrementalDetokenizer, byte_table

TEXT = "naïve café — 東京タワー 🚀🎉 done, ok? «quoted» ελληνικά\n\n  tabs\tand\u00a0nbsp"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from models.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def _random_ids(rng, table, n):
    """Ids that split multi-byte characters: half single-byte tokens (any byte, so invalid
    UTF-8 too), the rest anywhere in the vocabulary, special tokens and unknown ids included."""
    single = [i for i, b in enumerate(table) if len(b) == 1]
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.5:
            out.append(rng.choice(single))
        elif r < 0.55:
            out.append(rng.randrange(0, 17))  # SmolLM2's special tokens
        elif r < 0.57:
            out.append(len(table) + rng.randrange(100))  # past the vocabulary: decodes to ""
        else:
            out.append(rng.randrange(len(table)))
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_table_entry_decodes_as_the_backend_decodes_the_id(tok, skip):
    table = byte_table(tok, skip)
    assert table is not None and len(table) == len(tok)
    backend = tok.backend_tokenizer
    mismatched = [
        i
        for i, b in enumerate(table)
        if b.decode("utf-8", "replace") != backend.decode([i], skip_special_tokens=skip)
    ]
    assert mismatched == []
    assert (table[1] == b"") is skip  # <|im_start|>, special


@pytest.mark.parametrize("skip", [True, False])
def test_random_runs_decode_as_the_backend(tok, skip):
    table = byte_table(tok, skip)
    rng = random.Random(skip)
    for _ in range(2000):
        ids = _random_ids(rng, table, rng.randrange(1, 24))
        joined = b"".join(table[i] if i < len(table) else b"" for i in ids)
        assert joined.decode("utf-8", "replace") == tok.backend_tokenizer.decode(
            ids, skip_special_tokens=skip
        ), ids


@pytest.mark.parametrize("skip", [True, False])
def test_byte_path_deltas_equal_the_windowed_decode(tok, skip):
    rng = random.Random(7 + skip)
    table = byte_table(tok, skip)
    for trial in range(150):
        prompt = _random_ids(rng, table, rng.randrange(1, 9))
        ids = _random_ids(rng, table, rng.randrange(1, 300 if trial % 10 == 0 else 60))
        fast = IncrementalDetokenizer(tok, prompt, skip)
        slow = IncrementalDetokenizer(tok, prompt, skip, use_byte_table=False)
        assert fast._table is not None and slow._table is None
        for token in ids:
            assert fast.append(token) == slow.append(token), (prompt, ids)
            assert fast.text == slow.text
        assert fast.flush() == slow.flush()
        assert fast.text == slow.text
        context = tok.backend_tokenizer.decode(prompt[-5:], skip_special_tokens=skip)
        if not context.endswith("\ufffd"):  # a clean boundary: the text is the ids' own decode
            assert fast.text == tok.backend_tokenizer.decode(ids, skip_special_tokens=skip)


def test_valid_utf8_after_any_bytes_decodes_as_the_two_texts_joined():
    """The byte path's no-decode step (a token valid alone, after any prefix window)."""
    import itertools

    tokens = [t.encode() for t in ("a", " x", "é", "東", "🚀", "€a", "\ufffd")]
    for n in (1, 2):
        for prefix in map(bytes, itertools.product(range(256), repeat=n)):
            text = prefix.decode("utf-8", "replace")
            for token in tokens:
                assert (prefix + token).decode("utf-8", "replace") == text + token.decode()


def test_real_text_streams_whole_characters(tok):
    ids = tok(TEXT).input_ids
    table = byte_table(tok, True)
    byte_ids = {b[0]: i for i, b in enumerate(table) if len(b) == 1}
    split = [byte_ids[b] for b in TEXT.encode()]  # one token per byte: every character split
    for stream in (ids, split):
        detok = IncrementalDetokenizer(tok, tok("Say: ").input_ids)
        assert detok._table is not None
        deltas = [detok.append(t) for t in stream]
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == detok.text == tok.decode(stream)
    cut = [byte_ids[b] for b in "ok 🚀".encode()[:-1]]  # ends inside the emoji
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.append(t) for t in cut) == detok.text == "ok "
    assert detok.flush() == "\ufffd" and detok.text == tok.decode(cut)


def test_table_only_for_a_plain_byte_level_decoder(tok):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    assert byte_table(byte_tokenizer(), True) is not None
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    other = PreTrainedTokenizerFast(tokenizer_object=wordpiece, clean_up_tokenization_spaces=False)
    assert byte_table(other, True) is None
    detok = IncrementalDetokenizer(other, [1])
    assert [detok.append(t) for t in (2, 1)] and detok._table is None
    detok.flush()
    assert detok.text == other.backend_tokenizer.decode([1, 2, 1])[len("a") :]
    cleaned = PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, clean_up_tokenization_spaces=True
    )
    assert byte_table(cleaned, True) is None  # transformers' clean-up is not the backend's decode
