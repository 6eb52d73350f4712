"""Structured generation through the engine, on a tiny seeded Llama with a byte tokenizer.

Oracles: Python's `re` and `jsonschema` for constrained output; the same engine running the free
requests alone for the mixed-batch contract. The tiny model is random, so without the grammar
its output would match nothing; EOS is token 2 (the config's), which the grammar must end on.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from engine_helpers import save_engine_checkpoint

from ops.sampling.params import StructuredOutputSpec
from torch_runner import Engine, SamplingParams

EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
EBNF = 'root ::= pair (";" pair)*\npair ::= key "=" [0-9]+\nkey ::= "x" | "y" | "zz"'
EBNF_EQUIVALENT = r"(x|y|zz)=[0-9]+(;(x|y|zz)=[0-9]+)*"
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"enum": [1, 2, 3]},
        "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"},
        "inner": {
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
            "required": ["items"],
        },
    },
    "required": ["ok", "level", "tag", "inner"],
}
PROMPTS = [[5, 6, 7], list(range(20, 41)), [100] * 9, [42, 43]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path, _ = save_engine_checkpoint(
        "llama", tmp_path_factory.mktemp("grammar"), initializer_range=0.5
    )
    return Engine(str(path), device="cpu", max_total_tokens=4096, block_size=4)


def _params(kind=None, spec="", **kwargs):
    structured = StructuredOutputSpec(kind, spec) if kind else None
    return SamplingParams(structured=structured, **{"max_tokens": 80, **kwargs})


def test_regex_constrains_greedy_and_sampled_output(engine):
    params = [_params("regex", EMAIL, temperature=0.0)]
    params += [_params("regex", EMAIL, temperature=1.0, seed=s) for s in range(6)]
    outputs = engine.generate([PROMPTS[0]] * len(params), params)
    texts = [out.text for out in outputs]
    assert len(set(texts)) > 1  # sampling explored different strings
    for out in outputs:
        assert re.fullmatch(EMAIL, out.text), out.text
        assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # ended on EOS


def test_ebnf_grammar_constrains_output(engine):
    params = [_params("ebnf", EBNF, temperature=1.0, seed=s, max_tokens=200) for s in range(6)]
    for out in engine.generate([PROMPTS[1]] * len(params), params):
        if out.finish_reason == "stop":
            assert re.fullmatch(EBNF_EQUIVALENT, out.text), out.text
        else:  # ran out of tokens mid-grammar: still a prefix of the language
            assert re.fullmatch(r"((x|y|zz)=[0-9]+;)*((x|y|z|zz)(=[0-9]*)?)?", out.text), out.text


def test_json_schema_output_validates(engine):
    params = [
        _params("json_schema", json.dumps(SCHEMA), temperature=1.0, seed=s, max_tokens=100)
        for s in range(8)
    ]
    for out in engine.generate([PROMPTS[2]] * len(params), params):
        assert out.finish_reason == "stop", out.text
        document = json.loads(out.text)
        jsonschema.validate(document, SCHEMA)
        assert list(document) == list(SCHEMA["properties"])  # the schema's property order


def test_free_requests_in_a_mixed_batch_equal_their_solo_outputs(engine):
    free = _params(temperature=0.0, ignore_eos=True, max_tokens=24)
    solo = [engine.generate(p, free)[0].token_ids for p in (PROMPTS[1], PROMPTS[3])]
    mixed = engine.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]],
        [_params("regex", EMAIL, temperature=0.0), free, _params("ebnf", EBNF, seed=3), free],
    )
    assert [mixed[1].token_ids, mixed[3].token_ids] == solo
    assert re.fullmatch(EMAIL, mixed[0].text)


def test_logit_bias_combines_with_the_grammar_mask(engine):
    # +100 on "b" wins among allowed tokens; +100 on "z" cannot re-allow a forbidden token.
    params = _params("regex", "[ab]{5}", temperature=0.0, logit_bias={ord("b"): 100, ord("z"): 100})
    (out,) = engine.generate([PROMPTS[0]], params)
    assert out.text == "bbbbb"


def test_grammar_termination_ends_the_request_even_with_ignore_eos(engine):
    (out,) = engine.generate([PROMPTS[3]], _params("regex", "(yes|no)", ignore_eos=True))
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_invalid_grammar_is_a_value_error_naming_response_format(engine):
    with pytest.raises(ValueError, match='Rule "nope" is not defined') as info:
        engine.add_request(None, PROMPTS[0], _params("ebnf", "root ::= nope"))
    assert info.value.param == "response_format"
    assert not engine.has_unfinished()


def test_a_token_the_grammar_rejects_ends_the_request_without_being_output(engine):
    # A grammar left with no allowed token (complete, but its stop token masked or absent) gives
    # the sampler an all -inf row; whatever it picks must not be output, and the request ends
    # rather than writing that token until max_tokens. Oracle: the xgrammar matcher itself.
    from torch_runner.grammar.compiler import compiler_for
    from torch_runner.request_state import RequestState
    from torch_runner.sequence import Sequence

    grammar = compiler_for(engine.tokenizer, engine.vocab_size).new_request_grammar(
        "regex", "ab", stop_token_ids=engine.eos_token_ids
    )
    seq = Sequence("dead-end", [5, 6], _params())
    state = RequestState(seq, engine.tokenizer, engine.eos_token_ids, 64, grammar)
    a, b, c = (engine.tokenizer.encode(ch, add_special_tokens=False)[-1] for ch in "abc")
    assert state.append(a, None, None) is None and state.append(b, None, None) is None
    assert not grammar.matcher.accept_token(c)  # the matcher refuses "c" after "ab"
    assert state.append(c, None, None) == ("stop", None)
    assert seq.output_token_ids == [a, b] and state.visible_text() == "ab"
