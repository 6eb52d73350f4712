"""Request -> SamplingParams: n fans out with seed + i, API names in errors, no silent drops."""

from __future__ import annotations

import pytest

from ops.sampling.params import SamplingParams
from torch_runner.serve.errors import InvalidRequestError
from torch_runner.serve.params import chat_fields, completion_fields, expand_choices
from torch_runner.serve.protocol import ChatCompletionRequest, CompletionRequest

VOCAB = 256


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_choice_i_uses_seed_plus_i_wrapping_at_2_64():
    fields = chat_fields(_chat(seed=2**64 - 1), VOCAB)
    params = expand_choices(SamplingParams, fields, 3, 2**64 - 1, {})
    assert [p.seed for p in params] == [2**64 - 1, 0, 1]
    assert all(p.n == 1 for p in params)


def test_unseeded_choices_stay_unseeded():
    params = expand_choices(SamplingParams, chat_fields(_chat(), VOCAB), 2, None, {})
    assert [p.seed for p in params] == [None, None]


def test_every_sampling_field_reaches_sampling_params():
    request = _chat(
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.1, logit_bias={"7": -100}, stop=["x", "yz"], min_tokens=2, ignore_eos=True,
        stop_token_ids=[5], max_completion_tokens=9, logprobs=True, top_logprobs=4,
    )  # fmt: skip
    [params] = expand_choices(SamplingParams, chat_fields(request, VOCAB), 1, 3, {})
    expected = dict(
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.1, logit_bias={7: -100.0}, stop=["x", "yz"], min_tokens=2, ignore_eos=True,
        stop_token_ids=[5], max_tokens=9, logprobs=True, top_logprobs=4, seed=3,
    )  # fmt: skip
    assert {name: getattr(params, name) for name in expected} == expected


def test_chat_max_completion_tokens_wins_over_max_tokens():
    assert chat_fields(_chat(max_tokens=5, max_completion_tokens=7), VOCAB)["max_tokens"] == 7
    assert chat_fields(_chat(max_tokens=5), VOCAB)["max_tokens"] == 5
    assert chat_fields(_chat(), VOCAB)["max_tokens"] is None  # until the context ends


def test_completion_logprobs_int_means_top_alternatives():
    fields = completion_fields(CompletionRequest(prompt="a", logprobs=3), VOCAB)
    assert (fields["logprobs"], fields["top_logprobs"]) == (True, 3)
    assert "logprobs" not in completion_fields(CompletionRequest(prompt="a"), VOCAB)


def test_engine_validation_error_is_renamed_to_the_api_parameter():
    fields = chat_fields(_chat(max_completion_tokens=2, min_tokens=5), VOCAB)
    with pytest.raises(InvalidRequestError) as info:
        expand_choices(SamplingParams, fields, 1, None, {"max_tokens": "max_completion_tokens"})
    assert info.value.param == "min_tokens"
    fields = completion_fields(CompletionRequest(prompt="a", max_tokens=1, min_tokens=3), VOCAB)
    with pytest.raises(InvalidRequestError):
        expand_choices(SamplingParams, fields, 1, None, {})
