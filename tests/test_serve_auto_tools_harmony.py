"""`tool_choice: "auto"` on gpt-oss: harmony messages stay free, a call to `functions.NAME` is valid.

Oracles: xgrammar's `GrammarMatcher` over the grammar the server builds, with the real
o200k_harmony tokenizer, driven by seeded random choices among the allowed tokens; openai-harmony
parses the token ids on its own (every output must be well-formed harmony), every call's
recipient must be an offered function and its arguments validate with `jsonschema`. Over HTTP
(tiny random gpt-oss, official openai client), every call the random model writes is valid.
"""

from __future__ import annotations

import json
import random

import jsonschema
import openai_harmony as harmony
import pytest
import torch
import xgrammar as xgr
from harmony_tokenizer import save_harmony_tokenizer
from reasoning_helpers import USER, start, stream_message
from serve_fixtures import MODEL_NAME
from test_serve_auto_tools import FUNCTIONS, SCHEMAS
from tiny_models import build_tiny_model

from torch_runner.serve.harmony_tools import harmony_auto_grammar
from torch_runner.serve.reasoning.harmony import HarmonyParser

pytestmark = pytest.mark.slow  # the 201,088-token vocabulary, and a real HTTP server

VOCAB = 201088
ENDOFTEXT = 199999
NAMES = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")


@pytest.fixture(scope="module")
def compiled(harmony_tokenizer_dir, harmony_encoding):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(harmony_tokenizer_dir))
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=VOCAB, stop_token_ids=[ENDOFTEXT]
    )
    grammar = harmony_auto_grammar(harmony_encoding, FUNCTIONS)
    return harmony_encoding, xgr.GrammarCompiler(info).compile_grammar(grammar)


def _ids(encoding, text: str) -> list[int]:
    return encoding.encode(text, allowed_special="all")


def _allowed(matcher) -> torch.Tensor:
    """The allowed token ids, as a tensor (the vocabulary is 201,088 wide)."""
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, VOCAB)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return torch.nonzero(logits[0] > float("-inf")).flatten()


def _walk(encoding, grammar, prefix: str, seed: int) -> list[int]:
    """Accept `prefix`, then random allowed tokens; harmony's structure tokens are picked often
    (a body ends after a few tokens) so messages finish. Ends at <|return|> or <|call|>."""
    rng = random.Random(seed)
    structure = torch.tensor([_ids(encoding, n)[0] for n in NAMES])
    stops = {_ids(encoding, "<|return|>")[0], _ids(encoding, "<|call|>")[0]}
    matcher, ids = xgr.GrammarMatcher(grammar), _ids(encoding, prefix)
    assert all(matcher.accept_token(t) for t in ids), prefix
    for _ in range(400):
        allowed = _allowed(matcher)
        assert len(allowed), encoding.decode(ids)  # never a dead end
        ends = structure[torch.isin(structure, allowed)]
        pool = ends if len(ends) and rng.random() < 0.3 else allowed
        token = int(pool[rng.randrange(len(pool))])  # one host read per step: the walk's pick
        assert matcher.accept_token(token)
        ids.append(token)
        if token in stops:
            return ids
    pytest.fail(f"turn never ended: {encoding.decode(ids)!r}")


def _check(encoding, ids: list[int]) -> list[harmony.Message]:
    """openai-harmony reads the output; each call is to an offered function, schema-valid, and
    the server's own parser reads the same calls from the same ids (whatever their split)."""
    messages = encoding.parse_messages_from_completion_tokens(ids, harmony.Role.ASSISTANT)
    parsed = HarmonyParser(encoding=encoding).parse("", ids)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        (m.recipient.removeprefix("functions."), m.content[0].text) for m in messages if m.recipient
    ]
    for message in messages:
        if message.recipient:
            name = message.recipient.removeprefix("functions.")
            assert message.recipient == f"functions.{name}" and message.channel == "commentary"
            jsonschema.validate(json.loads(message.content[0].text), SCHEMAS[name])
        else:
            assert message.channel in ("analysis", "commentary", "final")
    return messages


@pytest.mark.parametrize("seed", range(12))
def test_a_started_call_is_an_offered_function_with_valid_arguments(compiled, seed):
    encoding, grammar = compiled
    prefix = "<|channel|>analysis<|message|>Let me check.<|end|><|start|>assistant"
    prefix += "<|channel|>commentary to=functions." if seed % 2 else " to=functions."
    ids = _walk(encoding, grammar, prefix, seed)
    messages = _check(encoding, ids)
    assert messages[-1].recipient in {f"functions.{f['name']}" for f in FUNCTIONS}


@pytest.mark.parametrize("seed", range(12))
def test_random_turns_are_well_formed_harmony(compiled, seed):
    encoding, grammar = compiled
    messages = _check(encoding, _walk(encoding, grammar, "", seed))
    assert messages and (messages[-1].recipient or messages[-1].channel == "final")


def test_bodies_are_free_and_unoffered_recipients_are_refused(compiled):
    encoding, grammar = compiled
    matcher = xgr.GrammarMatcher(grammar)
    assert all(matcher.accept_token(t) for t in _ids(encoding, "<|channel|>final<|message|>"))
    assert len(_allowed(matcher)) > VOCAB - 16  # all but harmony's structure tokens
    text = "Any words { at all } with to=functions.rm_rf in them."
    assert all(matcher.accept_token(t) for t in _ids(encoding, text + "<|return|>"))
    for bad in (
        "<|channel|>commentary to=functions.rm_rf",
        " to=functions.rm_rf",
        '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "x"',
        "<|channel|>analysis<|message|>thinking<|return|>",  # only a final message returns
    ):
        matcher = xgr.GrammarMatcher(grammar)
        assert not all(matcher.accept_token(t) for t in _ids(encoding, bad)), bad


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """Tiny random gpt-oss with the real o200k_harmony tokenizer (as tests/test_serve_harmony.py)."""
    path = tmp_path_factory.mktemp("gptoss_auto") / "tiny-gpt-oss"
    model = build_tiny_model(
        "gpt_oss",
        vocab_size=VOCAB,
        bos_token_id=199998,
        eos_token_id=200002,
        pad_token_id=ENDOFTEXT,
    )
    model.save_pretrained(path)
    save_harmony_tokenizer(path)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCH_RUNNER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        server, client, spy = start(path)
        yield client, spy
        server.stop()


def test_auto_calls_over_http_are_valid_and_stream_alike(gptoss, harmony_encoding):
    """The random model picks among the headers the grammar allows: some choices call, and
    every call the server returns is an offered function with schema-valid arguments."""
    client, spy = gptoss
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    request = dict(
        model=MODEL_NAME, messages=USER, tools=tools, max_tokens=48, temperature=1.0, n=6, seed=3
    )
    reply = client.chat.completions.create(**request)
    num_calls = 0
    for choice in reply.choices:
        _check(harmony_encoding, spy.outputs[f"{reply.id}-{choice.index}"])
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            num_calls += 1
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
    assert num_calls >= 1
    first = reply.choices[0].message
    content, reasoning, calls, _ = stream_message(client, **{**request, "n": 1})
    assert (content, reasoning) == (first.content, first.reasoning_content)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in first.tool_calls or []
    ]
