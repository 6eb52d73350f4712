"""Tool history through real families' chat templates (tests/tool_templates.py), and the default
tool prompt for a template without tools.

Oracles: transformers' `apply_chat_template` on the conversation in the shape its docs give
(call arguments as objects) must equal what the server renders from the OpenAI request; the
family's own call format must appear in the prompt. End to end, per family: the parser picked
from the template reads a call the model wrote in that family's format (a regex
response_format makes the tiny random model write it), and a round trip renders through the
template, Mistral's 9-character call ids included.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from engine_helpers import byte_tokenizer
from serve_fixtures import (
    API_KEY,
    CHAT_TEMPLATE,
    MODEL_NAME,
    ThreadedServer,
    save_serve_checkpoint,
)
from tool_templates import FAMILIES

from torch_runner.serve.output_parsers import default_tool_parser_name
from torch_runner.serve.prompts import chat_prompt
from torch_runner.serve.protocol import ChatCompletionRequest
from torch_runner.serve.tool_prompt import DEFAULT_TOOL_PROMPT

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": SCHEMA},
    }
]
CALL_ID = "abcDEF123"  # 9 alphanumerics: valid for every family, Mistral included
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": CALL_ID,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny"},
]
EXPECTED_PARSER = {
    "qwen2.5": "hermes",
    "qwen3": "hermes",
    "llama3.1": "llama3_json",
    "mistral": "mistral",
}
CALL_TEXT = {  # how each family writes the call, in its template and its output
    "qwen2.5": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "llama3.1": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "id": "abcDEF123"}]',
}
OUTPUT_REGEX = {
    "qwen2.5": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>',
    "llama3.1": r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)", "days": [1-7]\}\}',
    "mistral": r'\[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\]',
}
OUTPUT_REGEX["qwen3"] = OUTPUT_REGEX["qwen2.5"]


def _request(messages, **extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=messages, **extra)


def _hf_history():
    """The conversation as transformers documents it: arguments as a dict."""
    history = json.loads(json.dumps(HISTORY))
    call = history[2]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])
    history[2]["content"] = ""
    return history


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_history_renders_like_transformers_with_the_family_call_format(family):
    tokenizer = byte_tokenizer()
    template = FAMILIES[family]
    body = _request(HISTORY, tools=TOOLS)
    ids = chat_prompt(tokenizer, body.messages, TOOLS, chat_template=template)
    text = tokenizer.decode(ids)
    expected = tokenizer.apply_chat_template(
        _hf_history(),
        tools=TOOLS,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == expected
    assert CALL_TEXT[family] in text
    assert "sunny" in text and '"get_weather"' in text and "Forecast" in text
    assert default_tool_parser_name("llama", template) == EXPECTED_PARSER[family]


def test_template_without_tools_gets_the_default_tool_prompt():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    body = _request(HISTORY, tools=TOOLS)
    text = tokenizer.decode(chat_prompt(tokenizer, body.messages, TOOLS))
    block = DEFAULT_TOOL_PROMPT.format(tools=json.dumps(TOOLS[0]))
    assert text.startswith(f"<|system|>Be brief.\n\n{block}\n")
    assert CALL_TEXT["qwen2.5"] in text  # the assistant's call, in the format the prompt asks for
    assert "<|user|><tool_response>\nsunny\n</tool_response>\n" in text
    assert text.endswith("<|assistant|>")
    # without tools offered (tool_choice none) the history still renders, with no tool block
    bare = tokenizer.decode(chat_prompt(tokenizer, body.messages, None))
    assert "# Tools" not in bare and "<tool_response>" in bare
    assert default_tool_parser_name("qwen2", CHAT_TEMPLATE) == "hermes"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_serve_checkpoint(tmp_path_factory.mktemp("tool_templates") / "tiny")[0]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_server(request, checkpoint):
    server = ThreadedServer(
        checkpoint, max_total_tokens=8192, chat_template=FAMILIES[request.param]
    )
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120
    )
    yield request.param, server, client
    server.stop()


@pytest.mark.slow
def test_each_family_parses_its_own_format_and_round_trips(family_server):
    family, server, client = family_server
    assert server.state.tool_parser_name == EXPECTED_PARSER[family]
    messages = HISTORY[:2]
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        tools=TOOLS,
        max_tokens=150,
        temperature=0,
        response_format={"type": "regex", "regex": OUTPUT_REGEX[family]},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    if family == "mistral":
        assert len(call.id) == 9 and call.id.isalnum()
    forced = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=150,
        temperature=0,
        parallel_tool_calls=False,  # Llama 3.1's template takes one call per turn
    )
    [forced_call, *_] = forced.choices[0].message.tool_calls
    jsonschema.validate(json.loads(forced_call.function.arguments), SCHEMA)
    history = [
        *messages,
        forced.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": forced_call.id, "content": "sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL_NAME,
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    baseline = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tool_choice="none", max_tokens=1, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    # the call and its result were rendered into the prompt
    assert answer.usage.prompt_tokens > baseline.usage.prompt_tokens + len("sunny")


CONTENT_BEFORE = {  # family -> (what the model is made to write under auto, its content)
    "qwen2.5": ("Sure[.] " + OUTPUT_REGEX["qwen2.5"], "Sure."),
    "qwen3": ("<think>hmm</think>Sure[.] " + OUTPUT_REGEX["qwen3"], "Sure."),
    "llama3.1": (OUTPUT_REGEX["llama3.1"] + " Done[.]", "Done."),
    "mistral": ("Sure[.] " + OUTPUT_REGEX["mistral"], "Sure."),
}


@pytest.mark.slow
def test_auto_call_logprobs_cover_exactly_the_content(family_server):
    """Byte tokenizer: one token per character. Under `auto`, the call's text (and Qwen3's
    reasoning) are not content, so the logprob tokens spell exactly the content, in the JSON
    answer and chunk by chunk in the stream."""
    from reasoning_helpers import stream_content_logprobs

    family, _, client = family_server
    regex, content = CONTENT_BEFORE[family]
    request = dict(
        model=MODEL_NAME,
        messages=HISTORY[:2],
        tools=TOOLS,
        max_tokens=150,
        temperature=0,
        response_format={"type": "regex", "regex": regex},
    )
    reply = client.chat.completions.create(**request, logprobs=True)
    choice = reply.choices[0]
    assert choice.message.tool_calls and choice.message.content == content, choice
    assert "".join(item.token for item in choice.logprobs.content) == content
    pairs = stream_content_logprobs(client, **request)
    assert all(delta == tokens for delta, tokens in pairs), pairs
    assert "".join(delta for delta, _ in pairs) == content


@pytest.mark.slow
def test_llama3_auto_answer_opening_with_a_brace_is_a_valid_call(family_server):
    """Llama-3 JSON has no start marker: the server's grammar makes an answer whose first
    character is `{` one well-formed call (a logit bias makes the random model open with `{`)."""
    family, _, client = family_server
    if family != "llama3.1":
        pytest.skip("the Llama-3 JSON format only")
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=HISTORY[:2],
        tools=TOOLS,
        tool_choice="auto",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=1.0,
        seed=5,
        logit_bias={str(ord("{")): 100},
    )
    message = reply.choices[0].message
    [call] = message.tool_calls
    assert message.content is None and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
