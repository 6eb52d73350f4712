"""Tool-call parsers on known model outputs: what `parse` must return, and that a stream cut at
every position (and fed a character at a time) accumulates to exactly that (serve/parsing.py's
`accumulate` is the client's stream helper). Expected results are written out by hand; call
arguments are also checked with `json.loads` against the objects the text was built from.
"""

from __future__ import annotations

import json
import random

import pytest

from torch_runner.serve.parsing import (
    ChainedParser,
    DeltaMessage,
    FirstCallOnly,
    ParsedMessage,
    accumulate,
)
from torch_runner.serve.tool_parsers import (
    get_tool_parser,
    select_tool_parser,
    tool_parser_names,
)
from torch_runner.serve.tool_parsers.forced import NamedCallParser, RequiredCallsParser

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"q": 'a } ] " \\ </tool_call> {', "n": [1, {"x": None}], "ok": True}


def _summary(message: ParsedMessage):
    return message.content, [(c.name, c.arguments) for c in message.tool_calls]


def _stream(parser, pieces: list[str]) -> ParsedMessage:
    deltas = [parser.feed(piece, []) for piece in pieces] + [parser.finish()]
    return accumulate(deltas)


def check_every_split(make, text: str) -> ParsedMessage:
    """parse == the stream cut at each position == the stream a character at a time."""
    whole = make().parse(text, [])
    for cut in range(len(text) + 1):
        assert _summary(_stream(make(), [text[:cut], text[cut:]])) == _summary(whole), cut
    for a in range(0, len(text) + 1, 7):  # three pieces: two cuts
        for b in range(a, len(text) + 1, 5):
            pieces = [text[:a], text[a:b], text[b:]]
            assert _summary(_stream(make(), pieces)) == _summary(whole), (a, b)
    assert _summary(_stream(make(), list(text))) == _summary(whole)
    ids = {c.id for c in whole.tool_calls}
    assert len(ids) == len(whole.tool_calls) and all(ids)
    return whole


def _hermes_call(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


HERMES_CASES = [
    ("Just text, no calls.", ("Just text, no calls.", [])),
    (
        _hermes_call("get_weather", WEATHER),
        (None, [("get_weather", json.dumps(WEATHER))]),
    ),
    (
        "Let me check.\n\n"
        + _hermes_call("get_weather", WEATHER)
        + "\n"
        + _hermes_call("f", NESTED),
        ("Let me check.", [("get_weather", json.dumps(WEATHER)), ("f", json.dumps(NESTED))]),
    ),
    (  # arguments before the name, and as a JSON string
        '<tool_call>{"arguments": {"a": 1}, "name": "g"}</tool_call>'
        '<tool_call>{"name": "h", "arguments": "{\\"b\\": 2}"}</tool_call>',
        (None, [("g", '{"a": 1}'), ("h", '{"b": 2}')]),
    ),
    ('<tool_call>{"name": "noargs"}</tool_call>', (None, [("noargs", "{}")])),
    ("<tool_call>not json</tool_call> after", ("<tool_call>not json</tool_call> after", [])),
    ("a <tool_ca", ("a <tool_ca", [])),  # a partial tag at the end is content
    ('x <tool_call>{"name": "cut", "arguments": {"a": [1, 2', ("x", [("cut", '{"a": [1, 2')])),
]


@pytest.mark.parametrize("text, expected", HERMES_CASES)
def test_hermes_known_outputs_at_every_split(text, expected):
    parsed = check_every_split(lambda: get_tool_parser("hermes")(None), text)
    assert _summary(parsed) == expected


def test_hermes_arguments_are_the_json_the_model_wrote():
    text = _hermes_call("f", NESTED)
    [call] = get_tool_parser("hermes")(None).parse(text, []).tool_calls
    assert json.loads(call.arguments) == NESTED


LLAMA_CASES = [
    ("The weather is fine.", ("The weather is fine.", [])),
    (
        json.dumps({"name": "get_weather", "parameters": WEATHER}),
        (None, [("get_weather", json.dumps(WEATHER))]),
    ),
    (
        "<|python_tag|>"
        + json.dumps({"name": "a", "parameters": {}})
        + "; "
        + json.dumps({"name": "b", "parameters": NESTED}),
        (None, [("a", "{}"), ("b", json.dumps(NESTED))]),
    ),
    ('  {"answer": 42} is JSON, not a call', ('  {"answer": 42} is JSON, not a call', [])),
    ('{"name": "f", "parameters": {"x": 1}} then text', ("then text", [("f", '{"x": 1}')])),
]


@pytest.mark.parametrize("text, expected", LLAMA_CASES)
def test_llama3_json_known_outputs_at_every_split(text, expected):
    parsed = check_every_split(lambda: get_tool_parser("llama3_json")(None), text)
    assert _summary(parsed) == expected


MISTRAL_CASES = [
    ("No tools needed.", ("No tools needed.", [])),
    (  # v3 tokenizers: a JSON list
        "Checking. [TOOL_CALLS] "
        + json.dumps(
            [{"name": "get_weather", "arguments": WEATHER}, {"name": "b", "arguments": {}}]
        ),
        ("Checking.", [("get_weather", json.dumps(WEATHER)), ("b", "{}")]),
    ),
    (  # v11+ tokenizers: name[ARGS]{...}, one marker per call
        "[TOOL_CALLS]get_weather[ARGS]"
        + json.dumps(WEATHER)
        + "[TOOL_CALLS]f[ARGS]"
        + json.dumps(NESTED),
        (None, [("get_weather", json.dumps(WEATHER)), ("f", json.dumps(NESTED))]),
    ),
    ("a [TOOL_CA", ("a [TOOL_CA", [])),
]


@pytest.mark.parametrize("text, expected", MISTRAL_CASES)
def test_mistral_known_outputs_at_every_split(text, expected):
    parsed = check_every_split(lambda: get_tool_parser("mistral")(None), text)
    assert _summary(parsed) == expected


def test_mistral_ids_are_nine_alphanumerics_and_it_keeps_special_tokens():
    parser_cls = get_tool_parser("mistral")
    [call] = parser_cls(None).parse('[TOOL_CALLS][{"name": "f", "arguments": {}}]', []).tool_calls
    assert len(call.id) == 9 and call.id.isalnum()
    assert parser_cls.skip_special_tokens is False


def test_required_output_is_read_as_calls_at_every_split():
    text = json.dumps(
        [{"name": "get_weather", "parameters": WEATHER}, {"name": "f", "parameters": NESTED}]
    )
    parsed = check_every_split(RequiredCallsParser, text)
    assert _summary(parsed) == (
        None,
        [("get_weather", json.dumps(WEATHER)), ("f", json.dumps(NESTED))],
    )


def test_named_output_is_the_arguments_of_one_call():
    text = json.dumps(NESTED)
    parsed = check_every_split(lambda: NamedCallParser("f"), text)
    assert _summary(parsed) == (None, [("f", text)])
    first = NamedCallParser("f").feed('{"', [])
    assert first.tool_calls[0].id and first.tool_calls[0].name == "f"  # id and name come first


def test_stream_sends_the_name_before_any_argument():
    parser = get_tool_parser("hermes")(None)
    deltas = [parser.feed(char, []) for char in _hermes_call("get_weather", WEATHER)]
    pieces = [p for d in deltas for p in d.tool_calls]
    assert pieces[0].name == "get_weather" and pieces[0].id and pieces[0].arguments == ""
    assert all(p.name is None and p.id is None for p in pieces[1:])
    assert len(pieces) > 5  # the arguments arrive in pieces, not at the end


def test_first_call_only_keeps_index_zero():
    text = _hermes_call("a", {}) + _hermes_call("b", {})
    parsed = check_every_split(lambda: FirstCallOnly(get_tool_parser("hermes")(None)), text)
    assert [c.name for c in parsed.tool_calls] == ["a"]


class _ThinkParser:
    """A minimal `<think>` splitter (the other helper writes the real ones) to test chaining."""

    def __init__(self):
        self.text = ""
        self.sent = 0

    def _split(self, text):
        head, sep, tail = text.partition("</think>")
        return (head.removeprefix("<think>"), tail) if sep else (None, text)

    def feed(self, delta_text, ids):
        self.text += delta_text
        return DeltaMessage()

    def finish(self):
        reasoning, content = self._split(self.text)
        return DeltaMessage(content=content or None, reasoning_content=reasoning)

    def parse(self, text, ids):
        reasoning, content = self._split(text)
        return ParsedMessage(content=content or None, reasoning_content=reasoning)


def test_chained_reasoning_then_tools_agrees_with_parse():
    text = "<think>need weather</think>" + _hermes_call("get_weather", WEATHER)

    def make():
        return ChainedParser(_ThinkParser(), get_tool_parser("hermes")(None))

    parsed = check_every_split(make, text)
    assert parsed.reasoning_content == "need weather"
    assert _summary(parsed) == (None, [("get_weather", json.dumps(WEATHER))])


@pytest.mark.parametrize(
    "model_type, template, expected",
    [
        ("qwen2", "", "hermes"),
        ("qwen3", "", "hermes"),
        ("mistral", "", "mistral"),
        ("gpt_oss", "", "openai"),
        ("llama", "{{ '<|python_tag|>' }}{% if tools %}{% endif %}", "llama3_json"),
        ("llama", "{% if tools %}<tool_call>{% endif %}", "hermes"),
        ("llama", "{% for m in messages %}{% endfor %}", "hermes"),
        ("mistral", "{{ tools }}<tool_call>", "hermes"),  # a Hermes fine-tune of Mistral
    ],
)
def test_parser_selection_by_template_then_model_type(model_type, template, expected):
    assert select_tool_parser(model_type, template) == expected


def test_registry_names_and_unknown_name():
    assert {"hermes", "llama3_json", "mistral", "openai"} <= set(tool_parser_names())
    with pytest.raises(ValueError, match="allowed values: .*hermes"):
        get_tool_parser("nope")


FUZZ_PIECES = (
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[", "]",
    '"', "\\", ":", ",", ";", " ", "\n", "name", '"name"', '"arguments"', '"parameters"', '"f"',
    "abc", "1", "null", "<tool", "_call>", "[TOOL", '"id"',
)  # fmt: skip
FUZZ_PARSERS = {
    "hermes": lambda: get_tool_parser("hermes")(None),
    "llama3_json": lambda: get_tool_parser("llama3_json")(None),
    "mistral": lambda: get_tool_parser("mistral")(None),
    "required": RequiredCallsParser,
}


@pytest.mark.parametrize("name", sorted(FUZZ_PARSERS))
def test_random_marker_soup_streams_like_parse(name):
    """Seeded random mixes of markers, braces and quotes: a character-at-a-time stream and a
    stream cut at three random points both accumulate to `parse`."""
    make, rng = FUZZ_PARSERS[name], random.Random(name)
    for _ in range(500):
        text = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(1, 30)))
        whole = _summary(make().parse(text, []))
        assert _summary(_stream(make(), list(text))) == whole, text
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _summary(_stream(make(), pieces)) == whole, (text, cuts)


def test_only_auto_with_a_special_token_parser_keeps_special_tokens():
    from types import SimpleNamespace

    from torch_runner.serve.chat_format import ChatFormat
    from torch_runner.serve.output_parsers import keeps_special_tokens, make_output_parser
    from torch_runner.serve.tools import ToolPlan

    functions = [{"name": "f"}]
    mistral = SimpleNamespace(tool_parser_name="mistral", chat_format=ChatFormat(), tokenizer=None)
    hermes = SimpleNamespace(tool_parser_name="hermes", chat_format=ChatFormat(), tokenizer=None)
    assert keeps_special_tokens(mistral, ToolPlan(functions, "auto"))
    assert not keeps_special_tokens(mistral, ToolPlan(functions, "required"))
    assert not keeps_special_tokens(mistral, ToolPlan(functions, "none"))
    assert not keeps_special_tokens(hermes, ToolPlan(functions, "auto"))
    # forced calls on a Mistral model get Mistral-shaped ids (its template rejects others)
    [call] = (
        make_output_parser(mistral, ToolPlan(functions, "named", "f")).parse("{}", []).tool_calls
    )
    assert len(call.id) == 9 and call.id.isalnum()
