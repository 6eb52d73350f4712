"""Structured generation: compile grammars with xgrammar and track one matcher per request.

Why this shape: compiling a grammar against a tokenizer costs milliseconds to seconds (a nested
JSON schema walks the whole vocabulary), while a server sees the same `response_format` again and
again. So compiled grammars are cached per (tokenizer, kind, text) in an LRU, and the per-request
state is only a cheap `xgrammar.GrammarMatcher` wrapped in `RequestGrammar`. Turning the matcher's
bitmask into the sampler's additive edit row lives in `grammar_mask.py`.

Errors: an invalid schema, regex or EBNF grammar raises `GrammarError` (a ValueError) whose text
is xgrammar's own message, minus its C++ source-location prefix; the server maps it to HTTP 400
with param "response_format".
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
import xgrammar as xgr

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")
DEFAULT_MAX_CACHED_GRAMMARS = 128
# json_object means "some JSON object" (OpenAI semantics), not any JSON value. JSON output is
# compact (", " and ": " separators, no free whitespace): a sampled small model otherwise can spend
# its whole token budget on newlines inside a valid document.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'

# xgrammar prefixes C++ errors with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


class GrammarError(ValueError):
    """An invalid structured-output spec: names the kind and carries xgrammar's message."""

    param = "response_format"

    def __init__(self, kind: str, message: str):
        self.kind = kind
        self.message = message
        super().__init__(f"invalid {kind} for response_format: {message}")


def _clean_message(exc: BaseException) -> str:
    text = str(exc).strip()
    return _CPP_PREFIX.sub("", text).strip() or type(exc).__name__


def check_kind(kind: str) -> str:
    """Validate a grammar kind, naming the allowed values."""
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(
            str(kind), f"kind={kind!r} is not supported; allowed values: {', '.join(GRAMMAR_KINDS)}"
        )
    return kind


def normalize_spec(kind: str, spec: Any) -> str:
    """Canonical text for a spec: JSON schemas as compact JSON, others verbatim.

    A schema given as a dict (the server's pydantic model) and the same schema as text hit the
    same cache entry. Keys keep their order: properties are generated in the schema's order.
    """
    check_kind(kind)
    if kind == "json_object":
        return ""
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise GrammarError(kind, f"schema is not valid JSON: {exc}") from exc
        if not isinstance(spec, dict | bool):
            raise GrammarError(kind, f"schema must be a JSON object, got {type(spec).__name__}")
        return json.dumps(spec, separators=(",", ":"))
    if not isinstance(spec, str) or not spec:
        raise GrammarError(kind, f"{kind} must be a non-empty string")
    return spec


def validate_grammar(kind: str, spec: Any) -> str:
    """Parse a spec without a tokenizer (sub-millisecond); returns its canonical text.

    The server calls this before a request is queued, so a bad schema, regex or grammar is a 400
    even on a streaming request; the same xgrammar converters run again when compiling.
    """
    text = normalize_spec(kind, spec)
    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(kind, _clean_message(exc)) from exc
    return text


class GrammarCompilerCache:
    """Compiles grammars for one tokenizer; an LRU of compiled grammars keyed by (kind, text).

    `tokenizer` is a Hugging Face tokenizer (or an already built `xgrammar.TokenizerInfo`).

    `vocab_size` is the model's vocabulary (the logits width), which may exceed the tokenizer's
    (padded embedding tables); ids past the tokenizer are never allowed by the mask.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        *,
        max_entries: int = DEFAULT_MAX_CACHED_GRAMMARS,
        max_threads: int = 2,
    ):
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries} must be >= 1")
        if isinstance(tokenizer, xgr.TokenizerInfo):  # prebuilt (benchmarks, raw vocabularies)
            self.tokenizer_info = tokenizer
        else:
            self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size
            )
        self.vocab_size = int(self.tokenizer_info.vocab_size)
        # xgrammar's own cache is unbounded by default; ours is the bounded LRU.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_enabled=False
        )
        self._entries: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self.num_compiles = 0

    def __len__(self) -> int:
        return len(self._entries)

    def compile(self, kind: str, spec: Any) -> xgr.CompiledGrammar:
        """Compiled grammar for (kind, spec), from the LRU or freshly compiled."""
        text = normalize_spec(kind, spec)
        key = (kind, text)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit
        compiled = self._compile_uncached(kind, text)
        with self._lock:
            self.num_compiles += 1
            self._entries[key] = compiled
            self._entries.move_to_end(key)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
        return compiled

    def _compile_uncached(self, kind: str, text: str) -> xgr.CompiledGrammar:
        try:
            if kind in ("json_object", "json_schema"):
                schema = _JSON_OBJECT_SCHEMA if kind == "json_object" else text
                return self._compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            return self._compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(kind, _clean_message(exc)) from exc

    def new_request_grammar(
        self, kind: str, spec: Any, stop_token_ids: Iterable[int] | None = None
    ) -> RequestGrammar:
        """A fresh matcher for one request.

        `stop_token_ids` (the engine's EOS set) replaces the tokenizer's own stop tokens as the
        tokens that end a complete grammar; None keeps the tokenizer's.
        """
        return RequestGrammar(self.compile(kind, spec), self.vocab_size, stop_token_ids)


class RequestGrammar:
    """One request's grammar state: advanced with every accepted token.

    The matcher allows the tokenizer's stop tokens once the grammar is complete; accepting one
    terminates the matcher, which ends the request.
    """

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        vocab_size: int,
        stop_token_ids: Iterable[int] | None = None,
    ):
        stops = None if stop_token_ids is None else sorted({int(t) for t in stop_token_ids})
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self.vocab_size = vocab_size
        self.num_accepted = 0

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar rejects it (state unchanged)."""
        if self.matcher.is_terminated():
            return False
        is_accepted = bool(self.matcher.accept_token(int(token_id)))
        if is_accepted:
            self.num_accepted += 1
        return is_accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token bits into `bitmask[row]` (int32, CPU)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


# One compiler cache per live tokenizer object; dropped when the tokenizer is garbage collected.
_CACHES: weakref.WeakKeyDictionary[Any, dict[int | None, GrammarCompilerCache]] = (
    weakref.WeakKeyDictionary()
)
_CACHES_LOCK = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int | None = None) -> GrammarCompilerCache:
    """The shared `GrammarCompilerCache` for (tokenizer, vocab_size)."""
    with _CACHES_LOCK:
        per_tokenizer = _CACHES.setdefault(tokenizer, {})
        cache = per_tokenizer.get(vocab_size)
        if cache is None:
            cache = GrammarCompilerCache(tokenizer, vocab_size)
            per_tokenizer[vocab_size] = cache
        return cache
