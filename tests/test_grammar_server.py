"""response_format over real HTTP with the official openai client, on both endpoints.

The tiny random model's free output matches nothing, so a match proves the grammar was enforced
(oracles: `re`, `json` and `jsonschema`). Invalid specs must be a 400 with param
"response_format" carrying xgrammar's message, before anything is streamed.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from serve_fixtures import API_KEY, MODEL_NAME, ThreadedServer, save_serve_checkpoint

pytestmark = pytest.mark.slow  # a real HTTP server; CI still runs it

MESSAGES = [{"role": "user", "content": "Give me data"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "scores": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
        "meta": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
        },
    },
    "required": ["name", "scores", "meta"],
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "data", "schema": SCHEMA}}
REGEX = r"(red|green|blue)-[0-9]{2}"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path, _ = save_serve_checkpoint(tmp_path_factory.mktemp("grammar_serve") / "tiny")
    server = ThreadedServer(path, max_total_tokens=4096)
    yield openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120
    )
    server.stop()


def test_chat_json_schema_validates(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        response_format=JSON_SCHEMA_FORMAT,
        max_tokens=120,
        temperature=1.0,
        seed=0,
        n=3,  # three seeds in one batch
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_completions_json_schema_validates(client):
    reply = client.completions.create(
        model=MODEL_NAME,
        prompt="data:",
        max_tokens=120,
        temperature=0.0,
        extra_body={"response_format": JSON_SCHEMA_FORMAT},
    )
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_json_object_output_parses_to_an_object(client, endpoint):
    # A random model wanders inside JSON strings; a bias towards "}" ends the object quickly,
    # and the grammar still forces "{" first although "}" is the biased favourite.
    fields = dict(model=MODEL_NAME, max_tokens=100, temperature=0, logit_bias={"125": 30})
    body = {"response_format": {"type": "json_object"}}
    if endpoint == "chat":
        reply = client.chat.completions.create(messages=MESSAGES, extra_body=body, **fields)
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    else:
        reply = client.completions.create(prompt="json:", extra_body=body, **fields)
        text, finish = reply.choices[0].text, reply.choices[0].finish_reason
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)


def test_regex_and_grammar_extensions_constrain_streamed_output(client):
    regex_format = {"type": "regex", "regex": REGEX}
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=40,
        temperature=1.0,
        seed=7,
        stream=True,
        extra_body={"response_format": regex_format},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(REGEX, text), text
    grammar_format = {"type": "grammar", "grammar": 'root ::= ("ab" | "c")+ "."'}
    reply = client.completions.create(
        model=MODEL_NAME,
        prompt="go",
        max_tokens=60,
        temperature=1.0,
        seed=3,
        n=3,
        extra_body={"response_format": grammar_format},
    )
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            assert re.fullmatch(r"(ab|c)+\.", choice.text), choice.text
        else:
            assert re.fullmatch(r"(ab|c)*a?", choice.text), choice.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("response_format", "xgrammar_says"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}},
            'Unsupported type "objec"',
        ),
        ({"type": "regex", "regex": "(unclosed"}, "parenthesis is not closed"),
        ({"type": "grammar", "grammar": "root ::= undefined_rule"}, "is not defined"),
    ],
)
def test_invalid_schema_or_grammar_is_400_with_xgrammars_message(
    client, response_format, xgrammar_says, stream
):
    for create in (
        lambda: client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=8,
            stream=stream,
            extra_body={"response_format": response_format},
        ),
        lambda: client.completions.create(
            model=MODEL_NAME,
            prompt="x",
            max_tokens=8,
            stream=stream,
            extra_body={"response_format": response_format},
        ),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            create()
        assert info.value.status_code == 400
        error = info.value.body
        assert error["param"] == "response_format"
        assert xgrammar_says in error["message"]


def test_unknown_response_format_type_is_400_listing_allowed_values(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=8,
            extra_body={"response_format": {"type": "xml"}},
        )
    assert info.value.body["param"] == "response_format.type"
    assert "'json_schema'" in info.value.body["message"]
