"""The FastAPI application: routes, auth, body limit, metrics and error handlers.

`create_app(state)` takes a ready `ServingState` (engine already started), so the app can be built
around any engine in tests and by the CLI alike. Auth guards `/v1/*`, `/tokenize` and
`/detokenize`: `/health` and `/metrics` stay open for load balancers and scrapers, as in vLLM
and SGLang.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from torch_runner.serve.chat import create_chat_completion
from torch_runner.serve.completions import create_completion
from torch_runner.serve.drain import DrainGuard
from torch_runner.serve.errors import EngineStoppedError, error_response, install_error_handlers
from torch_runner.serve.metrics import CONTENT_TYPE
from torch_runner.serve.middleware import ApiKeyGuard, BodySizeLimit, RequestMetrics
from torch_runner.serve.offload import OffloadedJsonRoute
from torch_runner.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from torch_runner.serve.state import ServingState
from torch_runner.serve.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)

ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}
# one server-sent event: `data:` holds a JSON chunk (a *Response / chunk, or an error body) or
# the final "[DONE]"
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}
# generation also answers 500 (the model failed the request: non-finite logits) and, with
# "stream": true, 200 as server-sent events
GENERATION_RESPONSES = {
    **ERROR_RESPONSES,
    500: {"model": ErrorResponse},
    200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}},
}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
GUARDED_PREFIXES = ("/v1", "/tokenize", "/detokenize")  # --api-key; /health, /metrics stay open


def create_app(state: ServingState) -> FastAPI:
    """Build the OpenAI-compatible app around a started engine."""
    app = FastAPI(title="torch_runner", summary="OpenAI-compatible API over torch_runner's engine")
    app.state.serving = state
    app.router.route_class = OffloadedJsonRoute  # large JSON bodies decode off the event loop
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine loop runs; 503 once it has stopped or while the server drains."""
        if state.drain.is_draining:
            return state.drain.health()
        if not getattr(state.engine, "is_running", True):
            return error_response(
                EngineStoppedError("the engine loop is not running", code="engine_stopped")
            )
        stats = state.engine_stats()
        body = {
            "status": "ok",
            "num_running": stats.get("num_running"),
            "num_waiting": stats.get("num_waiting"),
        }
        return JSONResponse(body)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return ModelList(data=[state.model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def retrieve_model(model_id: str) -> ModelCard:
        """The served model by its name or the 'default' alias; 404 (model_not_found) otherwise."""
        state.check_model(model_id)
        return state.model_card(model_id)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt or chat messages -> token ids, count, max_model_len."""
        return tokenize(state, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's /detokenize: token ids -> the text (`prompt`)."""
        return detokenize(state, body)

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=GENERATION_RESPONSES,
    )
    async def completions(body: CompletionRequest, http: Request) -> Response:
        return await create_completion(state, body, http)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=GENERATION_RESPONSES,
    )
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        return await create_chat_completion(state, body, http)

    # Last added runs first: metrics see every outcome, auth precedes reading the body.
    app.add_middleware(BodySizeLimit, max_bytes=state.max_body_bytes)
    app.add_middleware(ApiKeyGuard, check=state.check_api_key, prefix=GUARDED_PREFIXES)
    app.add_middleware(DrainGuard, drain=state.drain, paths=GENERATION_PATHS)
    app.add_middleware(
        RequestMetrics, observe=state.metrics.observe_request, paths=GENERATION_PATHS
    )
    return app
