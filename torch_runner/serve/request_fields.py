"""Request fields beyond the sampling core: OpenAI's newer Chat Completions fields, vLLM's extras.

Every field here is either applied (params.py, guided.py) or accepted and ignored for the reason
docs/serving.md gives ("Request fields"), as vLLM accepts them; only a non-text `modalities` (audio
output, which a text model cannot produce) is a 400. Objects that are only ignored are
typed loosely (a dict), so a newer SDK's extra keys in them never break a request; unknown
top-level names stay a 400 (`extra="forbid"`), so typos are still caught.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Fields(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RefusalContentPart(_Fields):
    """An assistant turn of the history that refused: its text renders like content."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


class MediaContentPart(BaseModel):
    """Image, audio and file parts: parsed so the 400 can name them (text-only models)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file"]


class MessageExtraFields(_Fields):
    """Message fields of the reference beyond role/content/name/tool calls."""

    refusal: str | None = Field(None, description="assistant: a refusal; rendered as its text.")
    audio: dict[str, Any] | None = Field(None, description="assistant: refused unless null.")
    function_call: dict[str, Any] | None = Field(
        None, description="assistant (deprecated): {name, arguments}, taken as a tool call."
    )


class VllmExtraFields(_Fields):
    """vLLM's extensions that clients send through `extra_body` (both endpoints)."""

    guided_json: str | dict[str, Any] | None = Field(
        None, description="JSON schema (object or JSON text) the output must match."
    )
    guided_regex: str | None = Field(None, description="Regex the whole output must match.")
    guided_choice: list[str] | None = Field(
        None, min_length=1, description="The output is exactly one of these strings."
    )
    guided_grammar: str | None = Field(None, description="xgrammar EBNF grammar (rule `root`).")
    guided_decoding_backend: str | None = Field(
        None, description="Ignored: xgrammar is the one structured-output backend."
    )
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM >= 0.11: {json | regex | choice | grammar | json_object: true}.",
    )
    skip_special_tokens: bool = Field(True, description="Drop special tokens from the text.")
    spaces_between_special_tokens: bool = Field(
        True, description="Accepted; no effect with tokenizers-backed (fast) tokenizers."
    )
    include_stop_str_in_output: bool = Field(
        False, description="Keep the matched stop string at the end of the text."
    )


class VllmChatFields(_Fields):
    """vLLM's chat-template switches (chat endpoint and /tokenize with messages)."""

    add_generation_prompt: bool = Field(True, description="Open a new assistant turn.")
    continue_final_message: bool = Field(
        False, description="Continue the last (assistant) message instead of opening a turn."
    )


class OpenAIChatFields(_Fields):
    """Chat Completions fields that do not steer sampling here (see docs/serving.md)."""

    store: bool | None = Field(None, description="Ignored: nothing is stored.")
    metadata: dict[str, str] | None = Field(None, description="Ignored (goes with store).")
    service_tier: str | None = Field(None, description="Ignored: one tier.")
    prompt_cache_key: str | None = Field(
        None, description="Ignored: the prefix cache matches by content, for every request."
    )
    prompt_cache_retention: str | None = Field(None, description="Ignored (see prompt_cache_key).")
    prompt_cache_options: dict[str, Any] | None = Field(None, description="Ignored.")
    safety_identifier: str | None = Field(None, description="Ignored (no abuse monitoring).")
    verbosity: str | None = Field(None, description="Ignored: no length-steering model here.")
    prediction: dict[str, Any] | None = Field(
        None, description="Ignored: a latency hint; predicted outputs never change the answer."
    )
    modalities: list[str] | None = Field(None, description='Only ["text"].')
    audio: dict[str, Any] | None = Field(
        None, description='Ignored: audio output options; only used with modalities "audio".'
    )
    web_search_options: dict[str, Any] | None = Field(
        None, description="Ignored: no search tool; the model answers from its weights."
    )
    moderation: dict[str, Any] | None = Field(
        None, description="Ignored: no moderation model runs here."
    )
    functions: list[dict[str, Any]] | None = Field(
        None, description="Deprecated by OpenAI: taken as tools (answers carry tool_calls)."
    )
    function_call: str | dict[str, Any] | None = Field(
        None, description="Deprecated by OpenAI: taken as tool_choice."
    )
