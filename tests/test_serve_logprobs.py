"""Token strings and bytes for logprobs: a token's `bytes` are its exact bytes, even mid-character.

Oracle: for any text, the concatenated bytes of its tokens must be the text's UTF-8 encoding, and
every token's string must be what the tokenizer decodes for it alone.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from torch_runner.serve.logprobs import TokenTable, completion_logprobs

CORPUS = [
    "héllo wörld",
    "naïve café déjà vu",
    "日本語のテキスト",
    "emoji 🙂🚀 ok",
    "plain ascii text",
] * 20
TEXT = "héllo 日本 🙂 café 𝄞"  # 𝄞 is not in the corpus: its 4 bytes stay 4 tokens


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _word_level() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "héllo": 1, "日本": 2, "🙂": 3, "café": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_byte_level_token_bytes_concatenate_to_the_utf8_text():
    tokenizer = _byte_level_bpe()
    table = TokenTable(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    raw = b"".join(bytes(table.lookup(i)[1]) for i in ids)
    assert raw == TEXT.encode("utf-8")
    partial = [i for i in ids if not _is_utf8(bytes(table.lookup(i)[1]))]
    assert len(partial) >= 4  # tokens that end mid-character still carry their exact bytes
    for token_id in ids:
        assert table.text(token_id) == tokenizer.decode([token_id])


def test_non_byte_level_tokenizer_falls_back_to_decoded_text():
    tokenizer = _word_level()
    table = TokenTable(tokenizer)
    for token_id, word in [(1, "héllo"), (2, "日本"), (3, "🙂")]:
        assert table.lookup(token_id) == (word, list(word.encode("utf-8")))


@pytest.mark.parametrize("offset", [0, 5])
def test_completion_logprobs_offsets_follow_token_text(offset):
    tokenizer = _word_level()
    table = TokenTable(tokenizer)
    entries = [(-0.5, [(1, -0.5), (2, -1.0)]), (-0.25, [(3, -0.25)])]
    result = completion_logprobs(table, [1, 3], entries, offset)
    assert result.tokens == ["héllo", "🙂"]
    assert result.token_logprobs == [-0.5, -0.25]
    assert result.top_logprobs == [{"héllo": -0.5, "日本": -1.0}, {"🙂": -0.25}]
    assert result.text_offset == [offset, offset + len("héllo")]
