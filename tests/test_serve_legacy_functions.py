"""OpenAI's deprecated functions history: an assistant `function_call` and a `role: "function"`
result render as the tool call and tool result they became, through every family's template.

Oracles: transformers' `apply_chat_template` (and openai-harmony for gpt-oss) on the same
conversation written in the tools form by hand (the call id is the documented `call{index:05d}`
of the assistant message); over HTTP, the official openai client sends the legacy shapes
(`ChatCompletionFunctionMessageParam`) and gets an answer, or a 400 naming the field.
"""

from __future__ import annotations

import json

import openai
import pytest
from engine_helpers import byte_tokenizer
from serve_fixtures import API_KEY, CHAT_TEMPLATE, MODEL_NAME, ThreadedServer, save_serve_checkpoint
from test_tool_templates import SCHEMA, TOOLS
from tool_templates import FAMILIES

from torch_runner.serve.errors import InvalidRequestError
from torch_runner.serve.history import message_dicts
from torch_runner.serve.prompts import chat_prompt
from torch_runner.serve.protocol import ChatCompletionRequest

ARGUMENTS = '{"city": "Paris", "days": 2}'
LEGACY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "get_weather", "arguments": ARGUMENTS},
    },
    {"role": "function", "name": "get_weather", "content": "sunny"},
]


def _tools_form(arguments_as_object: bool = True):
    """The same conversation in the tools API, as transformers documents it."""
    arguments = json.loads(ARGUMENTS) if arguments_as_object else ARGUMENTS
    call = {"id": "call00002", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": arguments}
    return [
        LEGACY[0],
        LEGACY[1],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call00002", "name": "get_weather", "content": "sunny"},
    ]


def _messages(raw):
    return ChatCompletionRequest(model="m", messages=raw).messages


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_legacy_history_renders_as_the_tool_round_trip(family):
    tokenizer, template = byte_tokenizer(), FAMILIES[family]
    ids = chat_prompt(tokenizer, _messages(LEGACY), TOOLS, chat_template=template)
    expected = tokenizer.apply_chat_template(
        _tools_form(),
        tools=TOOLS,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tokenizer.decode(ids) == expected
    assert "sunny" in expected and "get_weather" in expected


def test_legacy_history_on_the_default_tool_prompt():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    text = tokenizer.decode(chat_prompt(tokenizer, _messages(LEGACY), TOOLS))
    assert text == tokenizer.decode(chat_prompt(tokenizer, _messages(_tools_form(False)), TOOLS))
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_legacy_history_renders_for_harmony(harmony_encoding):
    from torch_runner.serve.reasoning.harmony_prompt import render_harmony_prompt

    legacy = render_harmony_prompt(harmony_encoding, message_dicts(_messages(LEGACY)), TOOLS)
    tools_form = message_dicts(_messages(_tools_form(False)))
    assert legacy == render_harmony_prompt(harmony_encoding, tools_form, TOOLS)
    assert "functions.get_weather" in harmony_encoding.decode(legacy)


def test_a_result_answers_the_earliest_open_call_of_its_name():
    two = [
        LEGACY[1],
        {"role": "assistant", "function_call": {"name": "get_weather", "arguments": "{}"}},
        {"role": "function", "name": "get_weather", "content": "a"},
        {"role": "assistant", "function_call": {"name": "get_weather", "arguments": ""}},
        {"role": "function", "name": "get_weather", "content": "b"},
    ]
    entries = message_dicts(_messages(two))
    assert [e.get("tool_call_id") for e in entries] == [None, None, "call00001", None, "call00003"]
    assert entries[3]["tool_calls"][0]["function"]["arguments"] == {}


BAD = [
    ([LEGACY[1], {"role": "function", "content": "x"}], "messages.1.name"),
    ([LEGACY[1], {"role": "function", "name": "get_weather", "content": "x"}], "messages.1.name"),
    (LEGACY[:3] + [{"role": "function", "name": "other", "content": "x"}], "messages.3.name"),
    (
        [{**LEGACY[1], "function_call": {"name": "f", "arguments": "{}"}}],
        "messages.0.function_call",
    ),
    (
        [{"role": "assistant", "function_call": {"name": "f", "arguments": "{nope"}}],
        "messages.0.function_call.arguments",
    ),
    ([{"role": "assistant", "function_call": {"arguments": "{}"}}], "messages.0.function_call"),
    (LEGACY[:3] + [{**LEGACY[3], "tool_call_id": "call00002"}], "messages.3.tool_call_id"),
]


@pytest.mark.parametrize(("messages", "param"), BAD)
def test_malformed_legacy_history_names_the_field(messages, param):
    with pytest.raises(InvalidRequestError) as error:
        message_dicts(_messages(messages))
    assert error.value.param == param


@pytest.mark.slow
def test_the_openai_client_sends_legacy_functions_end_to_end(tmp_path):
    path, _ = save_serve_checkpoint(tmp_path / "tiny")
    server = ThreadedServer(path)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
        function = {"name": "get_weather", "description": "Forecast", "parameters": SCHEMA}
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=LEGACY, functions=[function], max_tokens=4
        )
        assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(
                model=MODEL_NAME, messages=LEGACY[:2] + LEGACY[3:], max_tokens=4
            )
        assert error.value.body["param"] == "messages.2.name"
        assert client.models.list().data  # the server is unaffected
    finally:
        server.stop()


def test_every_message_role_of_the_openai_sdk_is_accepted():
    """The roles come from the installed client's own message types (a newer SDK's fails here)."""
    import typing

    from openai.types.chat import ChatCompletionMessageParam

    roles = set()
    for param in typing.get_args(ChatCompletionMessageParam):
        roles |= set(typing.get_args(typing.get_type_hints(param)["role"]))
    assert "function" in roles
    for role in sorted(roles):
        message = {"role": role, "content": "x"}
        if role == "tool":
            message["tool_call_id"] = "c"
        if role == "function":
            message["name"] = "f"
        assert _messages([message])[0].role == role
