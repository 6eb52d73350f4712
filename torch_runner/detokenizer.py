"""Incremental detokenization and stop-string handling for streamed output.

Decoding one token at a time splits multi-byte characters (a byte-level BPE token can hold half
of a UTF-8 sequence) and loses the leading space some tokenizers attach to the previous token.
So, as vLLM does, each step decodes a short sliding window of ids twice: `ids[prefix:read]`
(already emitted) and `ids[prefix:]`; the difference is the new text, emitted only when it does
not end in U+FFFD (an incomplete character). The window starts on the last prompt tokens so the
first generated token decodes in context.

Byte-level BPE tokenizers (GPT-2 style: Llama-3, Qwen, SmolLM2, gpt-oss) decode a window as
`bytes(ids).decode("utf-8", "replace")`, so for them the same windows are decoded in Python from a
per-id bytes table built once per tokenizer (`byte_table`): ~0.1 us a token instead of two Rust
decode calls (~1 us each); the text is the same (tests/test_detokenizer_bytes.py).

Stop strings are not emitted: the text is cut where the first one starts, and while streaming
the longest tail that could still become a stop string is held back.
"""

from __future__ import annotations

import weakref
from functools import partial

CONTEXT_TOKENS = 5  # prompt tokens decoded as context before the first output token
TRIM_AT = 64  # drop ids before the decode window once it has moved this far


class IncrementalDetokenizer:
    """Turns appended token ids into text increments that never split a character.

    `use_byte_table=False` decodes through the tokenizer even when `byte_table` applies (the
    reference the byte path is tested and timed against)."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        use_byte_table: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # a fast tokenizer with no space clean-up decodes exactly as its Rust backend does; the
        # backend directly skips transformers' per-call argument conversion (~60% of a decode)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
            backend = tokenizer
        # bound once: a decode is ~1.5 us, a Python wrapper frame around it was another ~0.4
        self._decode = partial(backend.decode, skip_special_tokens=skip_special_tokens)
        context = [int(t) for t in prompt_token_ids[-CONTEXT_TOKENS:]]
        self._table = byte_table(tokenizer, skip_special_tokens) if use_byte_table else None
        self.text = ""
        if self._table is not None:
            # the windows as bytes: ids[prefix:read] (with its text) and ids[read:]
            self._texts = text_table(tokenizer, skip_special_tokens)
            self._prefix = b"".join(map(self._bytes_of, context))
            self._prefix_text = self._prefix.decode("utf-8", "replace")
            self._tail = b""
            self.append = self._append_bytes
            self.flush = self._flush_bytes
            return
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _bytes_of(self, token_id: int) -> bytes:
        table = self._table
        return table[token_id] if 0 <= token_id < len(table) else b""  # unknown ids: no text

    def append(self, token_id: int) -> str:
        """Add one token; returns the newly complete text (possibly empty)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._prefix_offset >= TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: emit whatever is left, incomplete characters included (as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _append_bytes(self, token_id: int) -> str:
        """`append` on the byte windows: the same decodes, done by bytes.decode. A token whose
        bytes are valid UTF-8 alone, after an empty tail, needs no decode: valid UTF-8 cannot
        complete or extend a broken sequence before it, so `(prefix + token).decode("utf-8",
        "replace")` is the prefix's text + the token's (tests/test_detokenizer_bytes.py checks
        every 1-2 byte prefix)."""
        table = self._table
        token_id = int(token_id)
        if not self._tail and 0 <= token_id < len(table):
            piece = self._texts[token_id]
            if piece and not piece.endswith("\ufffd"):
                self._prefix, self._prefix_text = table[token_id], piece
                self.text += piece
                return piece
        tail = self._tail + (table[token_id] if 0 <= token_id < len(table) else b"")
        new_text = (self._prefix + tail).decode("utf-8", "replace")
        prefix_text = self._prefix_text
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            self._tail = tail
            return ""
        delta = new_text[len(prefix_text) :]
        # the read offset becomes the prefix offset: the new prefix window is the old tail
        self._prefix, self._prefix_text, self._tail = tail, tail.decode("utf-8", "replace"), b""
        self.text += delta
        return delta

    def _flush_bytes(self) -> str:
        prefix_text = self._prefix_text
        new_text = (self._prefix + self._tail).decode("utf-8", "replace")
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix, self._prefix_text, self._tail = b"", "", b""
        self.text += delta
        return delta


# tokenizer -> {skip_special_tokens: table or None}; weak: a tokenizer's tables go with it
_BYTE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_table(tokenizer, skip_special_tokens: bool) -> list[bytes] | None:
    """The bytes each token id decodes to, when the tokenizer's decode is exactly
    `bytes(ids).decode("utf-8", "replace")` over them: a fast tokenizer with no space clean-up
    whose decoder is one ByteLevel. None otherwise (the windows are decoded by the tokenizer)."""
    return _cached(tokenizer, skip_special_tokens,
                   lambda: _build_byte_table(tokenizer, skip_special_tokens))  # fmt: skip


def text_table(tokenizer, skip_special_tokens: bool) -> list[str | None]:
    """Each id's text where its bytes (`byte_table`) are valid UTF-8 on their own, else None."""
    return _cached(tokenizer, ("text", skip_special_tokens),
                   lambda: [_strict_text(b) for b in byte_table(tokenizer, skip_special_tokens)])  # fmt: skip


def _cached(tokenizer, key, build):
    """The tokenizer's table under `key`, built by `build()` once per tokenizer."""
    try:
        tables = _BYTE_TABLES.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: build each time (still correct)
        tables = {}
    if key not in tables:
        tables[key] = build()
    return tables[key]


def _strict_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _build_byte_table(tokenizer, skip_special_tokens: bool) -> list[bytes] | None:
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    if type(backend.decoder) is not decoders.ByteLevel:
        return None
    char_bytes = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab = backend.get_vocab(with_added_tokens=True)  # token -> id
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    for token, token_id in vocab.items():
        if skip_special_tokens and token_id in special:
            continue
        # ByteLevel's decode: each char's byte, or the token's own UTF-8 when some char has none
        if all(ch in char_bytes for ch in token):
            table[token_id] = bytes(char_bytes[ch] for ch in token)
        else:
            table[token_id] = token.encode("utf-8")
    return table


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the one ByteLevel (de)coders use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest (index, stop string) occurring in `text` at or after `search_from`."""
    best = None
    for stop in stops:
        index = text.find(stop, max(0, search_from))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


class StopStrings:
    """`find_stop` / `holdback_length` over one request's stop strings, with the proper prefixes
    indexed by their last character: most steps' text ends in a character that ends none, and
    holds nothing back after one dict lookup (instead of an endswith per prefix length)."""

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.max_len = max(map(len, self.stops), default=0)
        by_last: dict[str, set[tuple[int, str]]] = {}
        for stop in self.stops:
            for size in range(1, len(stop)):
                by_last.setdefault(stop[size - 1], set()).add((size, stop[:size]))
        # longest first: the first prefix the text ends with is the holdback
        self._by_last = {c: sorted(p, reverse=True) for c, p in by_last.items()}

    def find(self, text: str, search_from: int) -> tuple[int, str] | None:
        return find_stop(text, self.stops, search_from)

    def holdback(self, text: str) -> int:
        """holdback_length(text, stops)."""
        if not text:
            return 0
        for size, prefix in self._by_last.get(text[-1], ()):
            if text.endswith(prefix):
                return size
        return 0


def holdback_length(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
