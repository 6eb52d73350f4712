"""SamplingParams: the user-facing sampling configuration, validated in one place.

It lives in `ops` (next to the sampler that consumes it) so every layer above can use it;
`torch_runner.SamplingParams` re-exports it. Ranges follow OpenAI / vLLM. Every error is a
`SamplingParamError` (a ValueError) carrying `.param`, the offending field, so the HTTP server
can answer 400 with `param` without parsing messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GREEDY_TEMPERATURE = 1e-5  # temperature below this means greedy (top_k = 1)
MAX_TOP_LOGPROBS = 20
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "ebnf")


class SamplingParamError(ValueError):
    """A sampling parameter is out of range; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the structured-output engine must enforce: `kind` and its spec string.

    `spec` is the JSON schema text (json_schema), a regex or an EBNF grammar; json_object takes
    no spec (an empty string).
    """

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise SamplingParamError(
                "structured.kind",
                f"{self.kind!r} is not supported; allowed values: {', '.join(STRUCTURED_KINDS)}",
            )
        if not isinstance(self.spec, str):
            raise SamplingParamError(
                "structured.spec", f"must be a string, got {type(self.spec).__name__}"
            )
        if self.kind != "json_object" and not self.spec:
            raise SamplingParamError(
                "structured.spec", f"kind {self.kind!r} needs a non-empty spec"
            )


@dataclass
class SamplingParams:
    """Per-request sampling parameters (OpenAI / vLLM names and ranges).

    logprobs: True returns the chosen token's logprob; top_logprobs (0..20) adds that many
    alternatives. Logprobs are log_softmax of the edited (penalised, biased, masked) logits
    divided by the temperature, before top-k / top-p / min-p filtering.
    max_tokens None means "until the context ends". stop_token_ids end generation like EOS.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    structured: StructuredOutputSpec | None = None

    def __post_init__(self):
        self.temperature = _number("temperature", self.temperature, 0.0, math.inf, ">= 0")
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, "0 < top_p <= 1", low_open=True)
        self.min_p = _number("min_p", self.min_p, 0.0, 1.0, "0 <= min_p <= 1")
        self.presence_penalty = _number(
            "presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]"
        )
        self.frequency_penalty = _number(
            "frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]"
        )
        self.repetition_penalty = _number(
            "repetition_penalty", self.repetition_penalty, 0.0, math.inf, "> 0", low_open=True
        )
        self.top_k = _integer("top_k", self.top_k)
        if self.top_k != -1 and self.top_k < 1:
            raise SamplingParamError(
                "top_k", f"{self.top_k} is out of range; allowed: -1 (whole vocabulary) or >= 1"
            )
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
            if not 0 <= self.seed < 2**64:
                raise SamplingParamError(
                    "seed", f"{self.seed} is out of range; allowed: 0 <= seed < 2**64"
                )
        self.logit_bias = _logit_bias(self.logit_bias)
        self.logprobs = _flag("logprobs", self.logprobs)
        self.top_logprobs = _integer("top_logprobs", self.top_logprobs)
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingParamError(
                "top_logprobs",
                f"{self.top_logprobs} is out of range; allowed: 0..{MAX_TOP_LOGPROBS}",
            )
        if self.top_logprobs and not self.logprobs:
            raise SamplingParamError("top_logprobs", "needs logprobs=True")
        if self.max_tokens is not None:
            self.max_tokens = _integer("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise SamplingParamError(
                    "max_tokens", f"{self.max_tokens} is out of range; allowed: >= 1 or None"
                )
        self.min_tokens = _integer("min_tokens", self.min_tokens)
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise SamplingParamError(
                "min_tokens",
                f"{self.min_tokens} is out of range; allowed: 0 <= min_tokens <= max_tokens",
            )
        self.stop = _stop(self.stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = [_integer("stop_token_ids", t) for t in self.stop_token_ids]
            if any(t < 0 for t in self.stop_token_ids):
                raise SamplingParamError("stop_token_ids", "token ids must be >= 0")
        self.n = _integer("n", self.n)
        if self.n < 1:
            raise SamplingParamError("n", f"{self.n} is out of range; allowed: >= 1")
        self.ignore_eos = _flag("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _flag("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _flag(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        if self.structured is not None and not isinstance(self.structured, StructuredOutputSpec):
            raise SamplingParamError(
                "structured", "must be a StructuredOutputSpec(kind, spec) or None"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def is_filtering(self) -> bool:
        """A random row whose draw needs the sorted filter chain (top-k / top-p / min-p)."""
        return not self.is_greedy and (self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _number(
    name: str, value, low: float, high: float, allowed: str, low_open: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingParamError(
            name, f"must be a number, got {type(value).__name__}; allowed: {allowed}"
        )
    value = float(value)
    if math.isnan(value) or value < low or value > high or (low_open and value == low):
        raise SamplingParamError(name, f"{value} is out of range; allowed: {allowed}")
    return value


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamError(name, f"must be an integer, got {type(value).__name__}")
    return int(value)


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamError(name, f"must be true or false, got {type(value).__name__}")
    return value


def _logit_bias(bias) -> dict[int, float] | None:
    """Keys may be ints or decimal strings (JSON object keys); values in [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise SamplingParamError("logit_bias", "must be a mapping token id -> bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key) if not isinstance(key, bool) else None
        except (TypeError, ValueError):
            token = None
        if token is None or token < 0 or (isinstance(key, float) and key != token):
            raise SamplingParamError(
                "logit_bias", f"key {key!r} is not a token id (an integer >= 0)"
            )
        out[token] = _number("logit_bias", value, -100.0, 100.0, "bias values in [-100, 100]")
    return out or None


def _stop(stop) -> list[str] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise SamplingParamError(
            "stop", "must be a non-empty string or a list of non-empty strings"
        )
    return list(stop) or None
