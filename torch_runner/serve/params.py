"""OpenAI request fields -> engine `SamplingParams`, one per choice.

`n` is expanded here rather than in the engine: each choice is its own engine request, and with a
seed choice i uses seed + i, so the choices differ yet every one of them reproduces. The engine's
`SamplingParams` validates ranges and raises a ValueError carrying `.param`; `build_params` maps it
to a 400 naming the API's field (e.g. `max_completion_tokens`, not the engine's `max_tokens`).
`structured_spec` is the one seam for `response_format`.
"""

from __future__ import annotations

from typing import Any

from torch_runner.serve.errors import InvalidRequestError, param_error
from torch_runner.serve.guided import guided_response_format
from torch_runner.serve.protocol import ChatCompletionRequest, CompletionRequest

SEED_MODULUS = 2**64


def structured_spec(response_format: dict[str, Any] | None, param: str = "response_format") -> Any:
    """Map `response_format` to the engine's structured-output spec (None = free text).

    The accepted shapes and their validation live in `torch_runner.grammar.formats`; a bad
    schema, regex or grammar is a 400 carrying xgrammar's message. `param` is the field the
    client used (a vLLM `guided_*` field becomes a response_format in serve/guided.py).
    """
    if response_format is None:
        return None
    from torch_runner.grammar.formats import spec_from_response_format  # imports xgrammar

    try:
        return spec_from_response_format(response_format)
    except ValueError as exc:
        if param == "response_format":
            raise param_error(exc) from None
        message = str(exc).replace("for response_format", f"for {param}")
        raise InvalidRequestError(message, param=param) from None


def parse_logit_bias(
    logit_bias: dict[str, float] | None, vocab_size: int
) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not logit_bias:
        return None
    parsed: dict[int, float] = {}
    for key, bias in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias key {key!r} is not a token id (an integer as a string)",
                param="logit_bias",
            ) from None
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {token_id} is out of range [0, {vocab_size})",
                param="logit_bias",
            )
        if not -100.0 <= bias <= 100.0:
            raise InvalidRequestError(
                f"logit_bias value {bias} for token {token_id} is out of range [-100, 100]",
                param="logit_bias",
            )
        parsed[token_id] = float(bias)
    return parsed


def _stop_list(stop: str | list[str] | None) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(s == "" for s in stops):
        raise InvalidRequestError("stop strings must be non-empty", param="stop")
    return stops or None


def _common_fields(
    request: CompletionRequest | ChatCompletionRequest, vocab_size: int
) -> dict[str, Any]:
    if request.top_k is not None and request.top_k != -1 and request.top_k < 1:
        raise InvalidRequestError(
            f"top_k={request.top_k} is invalid; expected -1 or >= 1", param="top_k"
        )
    fields: dict[str, Any] = {
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "logit_bias": parse_logit_bias(request.logit_bias, vocab_size),
        "stop": _stop_list(request.stop),
        "min_tokens": request.min_tokens,
        "ignore_eos": request.ignore_eos,
        "structured": structured_spec(*guided_response_format(request)),
        "skip_special_tokens": request.skip_special_tokens,
        "include_stop_str_in_output": request.include_stop_str_in_output,
    }
    optional = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty,
        "stop_token_ids": request.stop_token_ids,
    }
    fields.update({name: value for name, value in optional.items() if value is not None})
    return fields


def completion_fields(request: CompletionRequest, vocab_size: int) -> dict[str, Any]:
    if request.suffix is not None:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise InvalidRequestError(
            f"best_of={request.best_of} is not supported; allowed values: null or n ({request.n})",
            param="best_of",
        )
    if request.echo and request.logprobs is not None:
        raise InvalidRequestError(
            "echo with logprobs is not supported (prompt logprobs are not computed)", param="echo"
        )
    fields = _common_fields(request, vocab_size)
    fields["max_tokens"] = request.max_tokens
    if request.logprobs is not None:
        fields["logprobs"] = True
        fields["top_logprobs"] = request.logprobs
    return fields


def check_message_fields(i: int, message: Any) -> None:
    """Image/audio/file parts and assistant audio: 400 naming the field (a deprecated
    `function_call` is taken as a tool call: serve/history.py)."""
    if message.audio is not None:
        raise InvalidRequestError(
            f"messages.{i}.audio: audio is not supported; allowed value: null",
            param=f"messages.{i}.audio",
        )
    if message.refusal is not None and message.content is None:
        message.content = message.refusal  # the refused turn renders as its text
    for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
        if part.type in ("image_url", "input_audio", "file"):
            raise InvalidRequestError(
                f"messages.{i}.content.{j}: {part.type} content is not supported (text-only "
                "models); allowed part types: text, refusal",
                param=f"messages.{i}.content.{j}.type",
            )


def check_continuation(request: Any) -> None:
    """continue_final_message continues an assistant message: it must be last (vLLM's rule)."""
    if not request.continue_final_message:
        return
    if request.messages and request.messages[-1].role != "assistant":
        raise InvalidRequestError(
            "continue_final_message needs the last message to be the assistant's",
            param="continue_final_message",
        )


def check_chat_only_fields(request: ChatCompletionRequest) -> None:
    """`modalities` must be text only (no audio output); messages and continuation checks.

    `audio`, `web_search_options` and `moderation` are accepted and ignored (docs/serving.md,
    "Request fields"); `functions` / `function_call` are mapped onto tools (serve/tools.py)."""
    for i, message in enumerate(request.messages):
        check_message_fields(i, message)
    check_continuation(request)
    if request.modalities is not None and request.modalities != ["text"]:
        others = [m for m in request.modalities if m != "text"]
        raise InvalidRequestError(
            f"modalities {others or request.modalities} are not supported (no audio output); "
            "allowed: ['text']",
            param="modalities",
        )


def chat_fields(request: ChatCompletionRequest, vocab_size: int) -> dict[str, Any]:
    check_chat_only_fields(request)
    if request.top_logprobs and not request.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    fields = _common_fields(request, vocab_size)
    fields["max_tokens"] = (
        request.max_completion_tokens
        if request.max_completion_tokens is not None
        else request.max_tokens
    )
    if request.logprobs:
        fields["logprobs"] = True
        fields["top_logprobs"] = request.top_logprobs or 0
    return fields


def expand_choices(
    params_cls: type, fields: dict[str, Any], n: int, seed: int | None, param_names: dict[str, str]
) -> list[Any]:
    """One `SamplingParams` per choice; choice i gets seed + i (mod 2^64) when a seed is given."""
    params = []
    for index in range(n):
        choice_seed = None if seed is None else (seed + index) % SEED_MODULUS
        try:
            params.append(params_cls(**fields, n=1, seed=choice_seed))
        except ValueError as exc:
            raise param_error(exc, param_names) from None
    return params
