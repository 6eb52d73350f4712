"""SamplingParams validation: OpenAI / vLLM ranges, errors that name the field (`.param`)."""

import pytest

from ops.sampling.params import SamplingParamError, SamplingParams, StructuredOutputSpec


def test_defaults_are_openai_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.n, p.seed) == (16, 0, 1, None)
    assert p.logprobs is False and p.top_logprobs == 0 and p.skip_special_tokens is True
    assert not p.is_greedy and not p.is_filtering and not p.has_penalties


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", 0),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("presence_penalty", 2.01),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", [1, 2]),
        ("top_logprobs", 21),
        ("logprobs", 1),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("n", 0),
        ("seed", -1),
        ("seed", 2**64),
        ("seed", True),
        ("stop", [""]),
        ("stop", 5),
        ("stop_token_ids", [-3]),
        ("ignore_eos", "yes"),
        ("structured", "json"),
    ],
)
def test_out_of_range_value_names_field(field, value):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_top_logprobs_needs_logprobs():
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(top_logprobs=3)
    assert info.value.param == "top_logprobs"
    assert SamplingParams(logprobs=True, top_logprobs=20).top_logprobs == 20


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.param == "min_tokens"
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


def test_boundary_values_accepted():
    p = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2,
        seed=2**64 - 1,
        logit_bias={"7": -100, 3: 100.0},
        stop="###",
    )
    assert p.is_greedy and p.frequency_penalty == 2.0
    assert p.logit_bias == {7: -100.0, 3: 100.0}  # JSON string keys become token ids
    assert p.stop == ["###"]


def test_temperature_below_epsilon_is_greedy():
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams(temperature=0.0, top_k=5).is_filtering


def test_structured_kind_is_validated():
    assert (
        SamplingParams(structured=StructuredOutputSpec("json_object")).structured.kind
        == "json_object"
    )
    with pytest.raises(SamplingParamError) as info:
        StructuredOutputSpec("xml", "<a/>")
    assert info.value.param == "structured.kind"
    assert "json_schema" in str(info.value) and "ebnf" in str(info.value)
    with pytest.raises(SamplingParamError) as info:
        StructuredOutputSpec("regex", "")
    assert info.value.param == "structured.spec"
