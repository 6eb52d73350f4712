"""Token strings, bytes and logprob formatting for both endpoints.

Byte-level BPE tokens can end mid-character, so a token's `bytes` come from the tokenizer's byte
alphabet (GPT-2 `bytes_to_unicode`) when it has one; its `token` string is the decoded text
(U+FFFD for a partial character), as OpenAI returns it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from torch_runner.serve.protocol import CompletionLogprobs, TokenLogprob, TopLogprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in char -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


class TokenTable:
    """Per-token text and bytes, cached (the same ids recur in every response)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._is_byte_level = self._detect_byte_level()

    def _detect_byte_level(self, probe: str = " é🙂") -> bool:
        """Byte-level iff mapping the probe's token pieces through the byte alphabet gives its UTF-8."""
        try:
            ids = self._tokenizer.encode(probe, add_special_tokens=False)
            pieces = self._tokenizer.convert_ids_to_tokens(ids)
        except Exception:  # a tokenizer without these methods: fall back to decoded text
            return False
        decoder = _byte_decoder()
        chars = "".join(piece for piece in pieces if isinstance(piece, str))
        if not chars or any(ch not in decoder for ch in chars):
            return False
        return bytes(decoder[ch] for ch in chars) == probe.encode("utf-8")

    def lookup(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        raw = None
        if self._is_byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            decoder = _byte_decoder()
            if isinstance(piece, str) and piece and all(ch in decoder for ch in piece):
                raw = [decoder[ch] for ch in piece]
        if raw is None:
            raw = list(text.encode("utf-8"))
        self._cache[token_id] = (text, raw)
        return text, raw

    def text(self, token_id: int) -> str:
        return self.lookup(token_id)[0]


def message_token_count(
    token_ids: list[int], finish_reason: str | None, params: Any, eos_token_ids: frozenset[int]
) -> int:
    """How many of a finished choice's tokens make up its message.

    All but a final end-of-turn token (an EOS, or one of the request's stop_token_ids) that
    ended generation: its text is never part of the message, so chat logprobs leave it out
    (usage still counts it, as OpenAI and vLLM do).
    """
    if finish_reason != "stop" or not token_ids:
        return len(token_ids)
    last = token_ids[-1]
    is_eos = last in eos_token_ids and not getattr(params, "ignore_eos", False)
    if is_eos or last in (getattr(params, "stop_token_ids", None) or ()):
        return len(token_ids) - 1
    return len(token_ids)


def chat_logprobs(
    table: TokenTable, token_ids: list[int], entries: list[tuple[float, list[tuple[int, float]]]]
) -> list[TokenLogprob]:
    """OpenAI chat `logprobs.content`: one item per generated token, with its alternatives."""
    items = []
    for token_id, (logprob, top) in zip(token_ids, entries):
        text, raw = table.lookup(token_id)
        alternatives = [
            TopLogprob(token=table.text(i), logprob=lp, bytes=table.lookup(i)[1]) for i, lp in top
        ]
        items.append(
            TokenLogprob(token=text, logprob=logprob, bytes=raw, top_logprobs=alternatives)
        )
    return items


def completion_logprobs(
    table: TokenTable,
    token_ids: list[int],
    entries: list[tuple[float, list[tuple[int, float]]]],
    text_offset: int,
) -> CompletionLogprobs:
    """Legacy completions `logprobs`: parallel lists, `text_offset` counted from `text_offset`."""
    result = CompletionLogprobs()
    offset = text_offset
    for token_id, (logprob, top) in zip(token_ids, entries):
        text = table.text(token_id)
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append({table.text(i): lp for i, lp in top})
        result.text_offset.append(offset)
        offset += len(text)
    return result
