"""Tool calling on the embedded default model (SmolLM2-135M-Instruct, whose template has no tool
support: the default tool prompt and the hermes parser), through the official openai client.

Oracles: `jsonschema` for the forced calls (xgrammar must make even a 135M model write valid
arguments), the client's stream accumulator for stream == non-stream, and the round trip's
prompt growing by the tool result.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI
from serve_fixtures import ServerProcess

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": SCHEMA,
        },
    }
]
MESSAGES = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    server = ServerProcess(None, log_dir=tmp_path_factory.mktemp("tools_default"), num_threads=None)
    yield OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    server.stop()


def _valid(message):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_calls_validate_and_stream_equals_non_stream(client, tool_choice):
    args = dict(
        model="default",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    reply = client.chat.completions.create(**args)
    assert reply.choices[0].finish_reason == "tool_calls"
    _valid(reply.choices[0].message)
    with client.chat.completions.stream(**args) as stream:
        streamed = stream.get_final_completion()
    got = [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls]
    want = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls]
    assert got == want
    sampled = client.chat.completions.create(**{**args, "temperature": 1.0, "seed": 7, "n": 3})
    for choice in sampled.choices:
        _valid(choice.message)


def test_round_trip_answers_from_the_tool_result(client):
    first = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    message = first.choices[0].message
    [call] = message.tool_calls
    history = [
        *MESSAGES,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny, 24 C"}'},
    ]
    answer = client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, max_tokens=40, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_required_with_parallel_calls_ends_at_a_repeated_call(client):
    """`required` with parallel calls allowed (OpenAI's default) and no max_tokens: the 135M model
    would alternate Paris / Rome calls until the context is full; a call repeating an earlier
    one ends the list (serve/call_repeats.py). The answer comes back at once, with only
    distinct schema-valid calls, finish_reason "tool_calls", and the stream accumulates to it."""
    args = dict(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    fast = client.with_options(timeout=120)
    reply = fast.chat.completions.create(**args, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    _valid(choice.message)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    keys = [(name, json.dumps(arguments, sort_keys=True)) for name, arguments in calls]
    assert len(set(keys)) == len(keys), calls
    # generation stopped at the repeat: the calls, at most one more (dropped), no runaway list
    per_call = max(len(c.function.arguments) for c in choice.message.tool_calls) + 60
    assert reply.usage.completion_tokens < (len(calls) + 1) * per_call, reply.usage
    with fast.chat.completions.stream(**args, temperature=0) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    got = [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls]
    want = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert got == want
    sampled = fast.chat.completions.create(**args, temperature=1.0, seed=11, n=3)
    for other in sampled.choices:
        _valid(other.message)
        other_keys = [
            (c.function.name, json.dumps(json.loads(c.function.arguments), sort_keys=True))
            for c in other.message.tool_calls
        ]
        assert len(set(other_keys)) == len(other_keys)
