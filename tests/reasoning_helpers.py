"""Shared by the reasoning server tests: a spy on what reaches the engine, a started server, and
what the openai client builds from a stream."""

from __future__ import annotations

import re

import openai
from serve_fixtures import API_KEY, ThreadedServer

WORDS_RE = re.compile(r"[a-z][a-z ]{2,10}")  # what the grammars let the model write as words
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class EngineSpy:
    """Records what the server hands the engine (prompt ids) and what came back (output ids)."""

    def __init__(self, async_engine):
        self.prompts: list[list[int]] = []
        self.outputs: dict[str, list[int]] = {}
        original = async_engine.submit

        async def watch(request_id, stream):
            async for output in stream:
                self.outputs[request_id] = list(output.token_ids)
                yield output

        def submit(requests):
            self.prompts.extend(list(prompt_ids) for _, prompt_ids, _ in requests)
            streams = original(requests)
            return [watch(request_id, s) for (request_id, _, _), s in zip(requests, streams)]

        async_engine.submit = submit


def start(path):
    server = ThreadedServer(path, max_total_tokens=4096)
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120
    )
    return server, client, EngineSpy(server.async_engine)


def stream_message(client, **request):
    """What a client builds from the stream: content, reasoning, calls by index, finish reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                if piece.id:
                    assert call["id"] is None and call["arguments"] == ""  # id + name come first
                    call["id"], call["name"] = piece.id, piece.function.name
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, reasoning or None, [calls[i] for i in sorted(calls)], finish


def tokenize(client, **body) -> dict:
    """POST /tokenize (vLLM's, beside /v1) on the client's server."""
    import httpx

    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{base}/tokenize", json=body, headers=headers, timeout=60).json()


def stream_content_logprobs(client, **request) -> list[tuple[str, str]]:
    """Each streamed chunk's (content delta, its logprob tokens joined), chunks with either."""
    pairs = []
    for chunk in client.chat.completions.create(stream=True, logprobs=True, **request):
        for choice in chunk.choices:
            tokens = (
                "".join(t.token for t in (choice.logprobs.content or [])) if choice.logprobs else ""
            )
            if choice.delta.content or tokens:
                pairs.append((choice.delta.content or "", tokens))
    return pairs
