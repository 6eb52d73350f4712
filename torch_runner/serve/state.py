"""What every handler needs: the engine, the tokenizer, the served name, limits and metrics."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any

from torch_runner.serve.chat_format import ChatFormat
from torch_runner.serve.drain import Drain
from torch_runner.serve.errors import AuthenticationError, InvalidRequestError, NotFoundError
from torch_runner.serve.generation import Choice
from torch_runner.serve.generation_defaults import SamplingDefaults
from torch_runner.serve.logprobs import TokenTable
from torch_runner.serve.metrics import ChoiceTracker, ServerMetrics
from torch_runner.serve.offload import WorkerPool, warm_grammar
from torch_runner.serve.params import expand_choices
from torch_runner.serve.protocol import ModelCard

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MODEL_ALIAS = "default"
DEFAULT_MAX_CHOICES = 128  # prompts x n per HTTP request (each is one engine request)


@dataclass
class ServingState:
    """Shared, read-only per server (the engine itself is thread-safe behind AsyncEngine)."""

    engine: Any  # AsyncEngine: generate / abort / stats
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    params_cls: type  # SamplingParams
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_choices: int = DEFAULT_MAX_CHOICES
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    eos_token_ids: frozenset[int] = frozenset()  # end-of-turn ids: never part of a message
    model_type: str | None = None  # config.json's, for picking output parsers
    chat_template: str | None = None  # --chat-template: replaces the tokenizer's
    tool_parser_name: str = "hermes"  # the `auto` tool-call parser (vLLM's names)
    chat_format: ChatFormat = field(default_factory=ChatFormat)  # harmony / reasoning parser
    metrics: ServerMetrics = field(init=False)
    token_table: TokenTable = field(init=False)
    pool: WorkerPool = field(init=False)
    drain: Drain = field(default_factory=Drain)  # graceful-shutdown state (serve/drain.py)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.engine_stats, self.model_name)
        self.token_table = TokenTable(self.tokenizer)
        self.pool = WorkerPool()

    async def offload(self, fn, *args, **kwargs):
        """Run heavy work (tokenize, template, build choices or a big response) off the loop."""
        return await self.pool.run(fn, *args, **kwargs)

    def engine_stats(self) -> dict[str, Any]:
        return dict(self.engine.stats())

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model_name, DEFAULT_MODEL_ALIAS)

    def check_model(self, name: str | None) -> None:
        """Unknown model names are a 404, as OpenAI answers them."""
        if name is not None and name not in self.served_names:
            raise NotFoundError(
                f"The model {name!r} does not exist; this server serves {self.model_name!r} "
                f"(alias {DEFAULT_MODEL_ALIAS!r})",
                param="model",
                code="model_not_found",
            )

    def model_card(self, name: str | None = None) -> ModelCard:
        return ModelCard(
            id=name or self.model_name,
            root=self.model_name,
            max_model_len=self.max_model_len,
            sampling_defaults=dict(self.sampling_defaults.values),
        )

    def check_api_key(self, authorization: str | None) -> None:
        """With --api-key, `/v1/*` needs `Authorization: Bearer <key>` (constant-time compare)."""
        if self.api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise AuthenticationError(
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    def build_choices(
        self,
        request_id: str,
        prompts: list[list[int]],
        fields: dict[str, Any],
        n: int,
        seed: int | None,
        param_names: dict[str, str],
        arrived_at: float,
    ) -> list[Choice]:
        """prompts x n choices, OpenAI order: choice index = prompt index * n + i."""
        if len(prompts) * n > self.max_choices:
            raise InvalidRequestError(
                f"{len(prompts)} prompt(s) x n={n} = {len(prompts) * n} choices exceed this "
                f"server's limit of {self.max_choices} per request (--max-choices-per-request)",
                param="n" if n > 1 else "prompt",
                code="too_many_choices",
            )
        # generation_config.json defaults fill what the request left unset (fields omits those)
        fields = {**self.sampling_defaults.values, **fields}
        params = expand_choices(self.params_cls, fields, n, seed, param_names)
        warm_grammar(self.tokenizer, self.vocab_size, fields.get("structured"))
        choices = []
        for prompt_index, prompt_ids in enumerate(prompts):
            for i, choice_params in enumerate(params):
                index = prompt_index * n + i
                choices.append(
                    Choice(
                        index=index,
                        prompt_index=prompt_index,
                        request_id=f"{request_id}-{index}",
                        prompt_ids=prompt_ids,
                        params=choice_params,
                        tracker=ChoiceTracker(arrived_at),
                    )
                )
        return choices

    def record(self, choices: list[Choice]) -> None:
        """Feed finished (or aborted) choices into the metrics, once per HTTP request.

        A request the engine never produced anything for (refused, or gone while queued) adds
        no tokens; its HTTP status is still counted by the request middleware.
        """
        if not any(choice.has_output for choice in choices):
            return
        seen_prompts: set[int] = set()
        for choice in choices:
            if choice.prompt_index not in seen_prompts:
                seen_prompts.add(choice.prompt_index)
                self.metrics.observe_prompt(len(choice.prompt_ids), choice.num_cached_tokens)
            self.metrics.observe_choice(choice.tracker)
