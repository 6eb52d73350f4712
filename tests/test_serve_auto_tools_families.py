"""`tool_choice: "auto"` grammars of Mistral (`[TOOL_CALLS]`, v3 JSON list and v11 `NAME[ARGS]`)
and Llama-3 JSON (no marker: decided at the start of the message, as its parser decides).

Oracles: xgrammar's `GrammarMatcher` over the grammar the server builds, driven by seeded random
choices among the tokens its bitmask allows; the family's own parser reads the result and every
call's arguments are validated with `jsonschema` against the offered function's schema.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr
from engine_helpers import byte_tokenizer
from test_serve_auto_tools import FUNCTIONS, SCHEMAS

from torch_runner.serve.auto_tools import auto_tool_grammar
from torch_runner.serve.tool_parsers.llama3_json import Llama3JsonToolParser
from torch_runner.serve.tool_parsers.mistral import MistralToolParser

SEEDS = range(12)


def _setup(markers: list[str], parser: str, is_parallel: bool = True):
    """The byte tokenizer plus `markers` and `</s>` as special tokens; the compiled grammar."""
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [*markers, "</s>"]})
    vocab = tokenizer.get_added_vocab()
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[vocab["</s>"]]
    )
    grammar = auto_tool_grammar(parser, FUNCTIONS, is_parallel, vocab)
    return tokenizer, vocab, xgr.GrammarCompiler(info).compile_grammar(grammar)


def _allowed(matcher, size: int) -> list[int]:
    bitmask = xgr.allocate_token_bitmask(1, size)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, size)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return [i for i in range(size) if logits[0, i] > float("-inf")]


def _walk(tokenizer, grammar, prefix: str, seed: int, stop: int, steps: int = 600) -> str:
    """Accept `prefix`, then random allowed tokens until the end-of-turn token is allowed (the
    call is complete: inside a call it never is); returns the text, special tokens kept."""
    rng = random.Random(seed)
    matcher = xgr.GrammarMatcher(grammar)
    ids = tokenizer.encode(prefix, add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in ids), prefix
    for _ in range(steps):
        allowed = _allowed(matcher, len(tokenizer))
        assert allowed, tokenizer.decode(ids)  # never a dead end inside a call
        if stop in allowed:
            return tokenizer.decode(ids)
        token = rng.choice(allowed)
        assert matcher.accept_token(token)
        ids.append(token)
    pytest.fail(f"call never closed: {tokenizer.decode(ids)!r}")


def _check_calls(parsed, at_least: int = 1) -> None:
    assert len(parsed.tool_calls) >= at_least
    for call in parsed.tool_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("version", ["v3", "v11"])
def test_mistral_call_after_the_marker_is_schema_valid(seed, version):
    markers = ["[TOOL_CALLS]"] + (["[ARGS]"] if version == "v11" else [])
    tokenizer, vocab, grammar = _setup(markers, "mistral")
    text = _walk(tokenizer, grammar, "Sure. [TOOL_CALLS]", seed, vocab["</s>"])
    parsed = MistralToolParser().parse(text, [])
    assert parsed.content == "Sure."
    _check_calls(parsed)


def test_mistral_free_text_and_the_shapes_it_refuses():
    tokenizer, vocab, grammar = _setup(["[TOOL_CALLS]"], "mistral")
    ok = xgr.GrammarMatcher(grammar)
    assert all(ok.accept_token(t) for t in tokenizer.encode("Any text { [ at all."))
    assert set(range(32, 127)) <= set(_allowed(ok, len(tokenizer)))
    marker = vocab["[TOOL_CALLS]"]
    for bad in ('[{"name": "rm_rf"', '[{"name": "get_time", "arguments": {"zone": "cet"'):
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_token(marker)
        ids = tokenizer.encode(bad, add_special_tokens=False)
        assert not all(matcher.accept_token(t) for t in ids), bad
        # the marker spelled out one character at a time starts the call grammar too
        spelled, matcher = [ord(c) for c in "[TOOL_CALLS]"] + ids, xgr.GrammarMatcher(grammar)
        assert not all(matcher.accept_token(t) for t in spelled), bad


def test_mistral_v11_without_parallel_calls_ends_after_one():
    tokenizer, vocab, grammar = _setup(["[TOOL_CALLS]", "[ARGS]"], "mistral", is_parallel=False)
    matcher = xgr.GrammarMatcher(grammar)
    ids = [vocab["[TOOL_CALLS]"], *tokenizer.encode("get_time", add_special_tokens=False)]
    ids += [vocab["[ARGS]"], *tokenizer.encode('{"zone": "CET"}', add_special_tokens=False)]
    assert all(matcher.accept_token(t) for t in ids)
    assert _allowed(matcher, len(tokenizer)) == [vocab["</s>"]]


@pytest.mark.parametrize("seed", SEEDS)
def test_llama3_answer_opening_with_a_brace_is_only_calls(seed):
    tokenizer, vocab, grammar = _setup(["<|python_tag|>"], "llama3_json")
    prefix = "<|python_tag|>{" if seed % 3 == 0 else ("\n{" if seed % 3 == 1 else "{")
    text = _walk(tokenizer, grammar, prefix, seed, vocab["</s>"])
    parsed = Llama3JsonToolParser().parse(text.replace("<|python_tag|>", ""), [])
    assert parsed.content is None
    _check_calls(parsed)


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_llama3_parallel_calls_each_validate(seed):
    tokenizer, vocab, grammar = _setup(["<|python_tag|>"], "llama3_json")
    first = '{"name": "get_time", "parameters": {"zone": "UTC"}}; '
    text = _walk(tokenizer, grammar, first, seed, vocab["</s>"])
    parsed = Llama3JsonToolParser().parse(text, [])
    assert parsed.content is None
    _check_calls(parsed, at_least=2)


def test_llama3_text_stays_free_and_a_late_brace_is_text():
    tokenizer, _, grammar = _setup([], "llama3_json")
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string('The answer: {"name": "anything", "x": [1, 2')
    assert set(range(32, 127)) <= set(_allowed(matcher, len(tokenizer)))
    assert xgr.GrammarMatcher(grammar).accept_string("<|python? no, <b>bold</b>")
    for bad in ('  {"nmae', '{"name": "rm_rf"', '{"name": "get_time", "parameters": {"zone": "c'):
        assert not xgr.GrammarMatcher(grammar).accept_string(bad), bad
    assert not xgr.GrammarMatcher(grammar).accept_string('<|python_tag|>{"name": "rm_rf"')


def test_llama3_without_parallel_calls_ends_after_one():
    tokenizer, vocab, grammar = _setup([], "llama3_json", is_parallel=False)
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string('{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert not matcher.accept_string(";")
