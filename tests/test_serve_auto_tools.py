"""`tool_choice: "auto"` for hermes, Mistral and Llama-3 JSON: free text, but a started call is
a valid call.

Oracles: xgrammar's own `GrammarMatcher` walks the grammar the server builds (random allowed
tokens from its bitmask, seeded) after the output has started a call (`<tool_call>`, the
`[TOOL_CALLS]` token, a first `{`); every completed call is parsed by the family's own parser and
validated with `jsonschema`; names must be offered functions. Free text before the trigger must
keep the whole byte vocabulary. gpt-oss harmony: tests/test_serve_auto_tools_harmony.py.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr
from engine_helpers import byte_tokenizer

from torch_runner.serve.auto_tools import auto_tool_grammar
from torch_runner.serve.tool_parsers.hermes import HermesToolParser

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
FUNCTIONS = [
    {"name": "get_weather", "parameters": WEATHER},
    {"name": "get_time", "parameters": TIME},
]
SCHEMAS = {f["name"]: f["parameters"] for f in FUNCTIONS}
STOP = 0  # the NUL byte stands in for the end-of-turn token


@pytest.fixture(scope="module")
def compiled():
    tokenizer = byte_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=256, stop_token_ids=[STOP])
    grammar = auto_tool_grammar("hermes", FUNCTIONS, is_parallel=True)
    return tokenizer, xgr.GrammarCompiler(info).compile_grammar(grammar)


def _allowed(matcher) -> list[int]:
    bitmask = xgr.allocate_token_bitmask(1, 256)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, 256)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return [i for i in range(256) if logits[0, i] > float("-inf")]


def test_free_text_keeps_the_whole_vocabulary(compiled):
    tokenizer, grammar = compiled
    matcher = xgr.GrammarMatcher(grammar)
    printable = set(range(32, 127))
    assert printable <= set(_allowed(matcher))
    assert matcher.accept_string("Plain words, no call: a < b > c.")
    assert printable <= set(_allowed(matcher)) and STOP in _allowed(matcher)


@pytest.mark.parametrize("seed", range(12))
def test_a_started_call_always_completes_as_a_schema_valid_call(compiled, seed):
    tokenizer, grammar = compiled
    rng = random.Random(seed)
    matcher = xgr.GrammarMatcher(grammar)
    text = "Sure. <tool_call>"
    assert matcher.accept_string(text)
    for _ in range(400):
        allowed = _allowed(matcher)
        assert allowed, text  # never a dead end inside a call
        token = rng.choice(allowed)
        assert matcher.accept_token(token)
        text += tokenizer.decode([token])
        if text.endswith("</tool_call>"):
            break
    else:
        pytest.fail(f"call never closed: {text!r}")
    parsed = HermesToolParser().parse(text, [])
    assert parsed.content == "Sure."
    [call] = parsed.tool_calls
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_no_second_call_without_parallel_tool_calls():
    tokenizer = byte_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=256, stop_token_ids=[STOP])
    grammar = auto_tool_grammar("hermes", FUNCTIONS, is_parallel=False)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    assert matcher.accept_string("ok " + call)
    assert _allowed(matcher) == [STOP]


def test_unconstrained_cases_return_no_grammar():
    """A parser without a grammar; Llama-3 behind `<think>` (its message starts later)."""
    assert auto_tool_grammar("nonexistent", FUNCTIONS, is_parallel=True) is None
    assert auto_tool_grammar("llama3_json", FUNCTIONS, True, {}, has_reasoning=True) is None
    assert auto_tool_grammar("hermes", FUNCTIONS, True, {}, has_reasoning=True) is not None
