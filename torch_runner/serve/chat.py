"""POST /v1/chat/completions: messages through the chat template, n choices, logprobs, streaming."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from torch_runner.serve.generation import (
    Choice,
    Increment,
    run_choices,
    usage_of,
)
from torch_runner.serve.logprobs import chat_logprobs, message_token_count
from torch_runner.serve.params import chat_fields
from torch_runner.serve.prompts import chat_prompt, check_context
from torch_runner.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChoiceLogprobs,
)
from torch_runner.serve.sse import stream_choices
from torch_runner.serve.state import ServingState


def _param_names(body: ChatCompletionRequest) -> dict[str, str]:
    """SamplingParams field -> the parameter this request actually used."""
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    return {"max_tokens": max_name, "structured": "response_format"}


async def create_chat_completion(
    state: ServingState, body: ChatCompletionRequest, http: Request
) -> Response:
    """Render messages with the chat template, fan out n choices; answer as JSON or SSE."""
    arrived_at = time.perf_counter()
    state.check_model(body.model)
    fields = chat_fields(body, state.vocab_size)
    prompt_ids = chat_prompt(state.tokenizer, body.messages)
    max_name = _param_names(body)["max_tokens"]
    check_context(len(prompt_ids), fields["max_tokens"], state.max_model_len, "messages", max_name)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    choices = state.build_choices(
        request_id, [prompt_ids], fields, body.n, body.seed, _param_names(body), arrived_at
    )
    model = body.model or state.model_name

    if body.stream:
        return await _stream(state, body, http, choices, request_id, model)
    if not await run_choices(http, state.engine, choices, on_close=lambda: state.record(choices)):
        return Response(status_code=499)
    response = ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=[_final_choice(state, body, choice) for choice in choices],
        usage=usage_of(choices),
    )
    return JSONResponse(response.model_dump())


def _logprobs(
    state: ServingState, body: ChatCompletionRequest, token_ids, entries
) -> ChoiceLogprobs | None:
    if not body.logprobs:
        return None
    return ChoiceLogprobs(content=chat_logprobs(state.token_table, token_ids, entries))


def _message_tokens(state: ServingState, choice: Choice) -> int:
    return message_token_count(
        choice.token_ids, choice.finish_reason, choice.params, state.eos_token_ids
    )


def _final_choice(state: ServingState, body: ChatCompletionRequest, choice: Choice) -> ChatChoice:
    num_tokens = _message_tokens(state, choice)
    return ChatChoice(
        index=choice.index,
        message=ChatResponseMessage(content=choice.text),
        logprobs=_logprobs(
            state, body, choice.token_ids[:num_tokens], choice.logprobs[:num_tokens]
        ),
        finish_reason=choice.finish_reason,
    )


async def _stream(
    state: ServingState,
    body: ChatCompletionRequest,
    http: Request,
    choices: list[Choice],
    request_id: str,
    model: str,
) -> Response:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choice_list: list[ChatChunkChoice], usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, model=model, choices=choice_list, usage=usage)

    def opening():
        for choice in choices:
            yield chunk(
                [ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))]
            )

    def render(increment: Increment):
        choice = increment.choice
        if increment.is_empty:
            return
        delta = ChatDelta(content=increment.delta_text)
        # pair each logprob entry with its own token (entries can trail the ids by an output),
        # and leave out a final end-of-turn token (see _final_choice)
        entries, start = increment.delta_logprobs, increment.logprob_start
        if increment.is_final:
            entries = entries[: max(0, _message_tokens(state, choice) - start)]
        delta_ids = choice.token_ids[start : start + len(entries)]
        logprobs = _logprobs(state, body, delta_ids, entries)
        yield chunk(
            [
                ChatChunkChoice(
                    index=choice.index,
                    delta=delta,
                    logprobs=logprobs,
                    finish_reason=increment.finish_reason,
                )
            ]
        )

    return await stream_choices(
        http,
        state.engine,
        choices,
        opening=opening,
        render=render,
        usage_chunk=(lambda usage: chunk([], usage)) if include_usage else None,
        on_close=lambda: state.record(choices),
    )
