"""POST /v1/completions: prompts (text or token ids) x n choices, echo, logprobs, streaming."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from torch_runner.serve.generation import (
    Choice,
    Increment,
    run_choices,
    usage_of,
)
from torch_runner.serve.logprobs import completion_logprobs
from torch_runner.serve.offload import json_response
from torch_runner.serve.params import completion_fields
from torch_runner.serve.prompts import check_context, completion_prompts
from torch_runner.serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from torch_runner.serve.sse import stream_choices
from torch_runner.serve.state import ServingState

# SamplingParams field -> this endpoint's parameter name, for 400s raised by the engine's validation.
PARAM_NAMES = {"top_logprobs": "logprobs", "structured": "response_format"}


async def create_completion(
    state: ServingState, body: CompletionRequest, http: Request
) -> Response:
    """Validate, tokenize, fan out prompts x n to the engine; answer as JSON or SSE."""
    arrived_at = time.perf_counter()
    state.check_model(body.model)
    fields = await state.offload(completion_fields, body, state.vocab_size)
    prompts = await state.offload(
        completion_prompts, state.tokenizer, body.prompt, state.vocab_size
    )
    for prompt_ids, _ in prompts:
        check_context(len(prompt_ids), body.max_tokens, state.max_model_len, "prompt", "max_tokens")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    choices = await state.offload(
        state.build_choices,
        request_id,
        [ids for ids, _ in prompts],
        fields,
        body.n,
        body.seed,
        PARAM_NAMES,
        arrived_at,
    )
    echo_texts = [text if body.echo else "" for _, text in prompts]
    model = body.model or state.model_name

    if body.stream:
        return await _stream(state, body, http, choices, echo_texts, request_id, model)
    if not await run_choices(http, state.engine, choices, on_close=lambda: state.record(choices)):
        return Response(status_code=499)
    response = await state.offload(
        lambda: CompletionResponse(
            id=request_id,
            model=model,
            choices=[
                _final_choice(state, body, choice, echo_texts[choice.prompt_index])
                for choice in choices
            ],
            usage=usage_of(choices),
        )
    )
    return await state.offload(json_response, response)


def _final_choice(
    state: ServingState, body: CompletionRequest, choice: Choice, echo: str
) -> CompletionChoice:
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(
            state.token_table, choice.token_ids, choice.logprobs, len(echo)
        )
    return CompletionChoice(
        index=choice.index,
        text=echo + choice.text,
        logprobs=logprobs,
        finish_reason=choice.finish_reason,
    )


async def _stream(
    state: ServingState,
    body: CompletionRequest,
    http: Request,
    choices: list[Choice],
    echo_texts: list[str],
    request_id: str,
    model: str,
) -> Response:
    offsets = {choice.index: len(echo_texts[choice.prompt_index]) for choice in choices}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choice_list: list[CompletionChoice], usage=None) -> CompletionResponse:
        return CompletionResponse(id=request_id, model=model, choices=choice_list, usage=usage)

    def opening():
        for choice in choices:
            if echo_texts[choice.prompt_index]:
                yield chunk(
                    [CompletionChoice(index=choice.index, text=echo_texts[choice.prompt_index])]
                )

    def render(increment: Increment):
        choice = increment.choice
        if increment.is_empty:
            return
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(
                state.token_table,
                increment.delta_token_ids,
                increment.delta_logprobs,
                offsets[choice.index],
            )
            offsets[choice.index] += sum(len(t) for t in logprobs.tokens)
        yield chunk(
            [
                CompletionChoice(
                    index=choice.index,
                    text=increment.delta_text,
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
