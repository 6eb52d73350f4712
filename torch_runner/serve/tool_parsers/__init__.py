"""serve.tool_parsers: one file per tool-call format (hermes, llama3_json, mistral, harmony), a registry by
vLLM's parser names. Pure text/token parsing over serve.parsing: imports no engine, runner or torch.

A parser module registers its class with `@register_tool_parser(name)`; `get_tool_parser` imports
the module that provides a name on first use, so a parser living elsewhere (gpt-oss harmony's
`openai`, in serve/reasoning/harmony.py) joins the registry by being listed in `_MODULES`.
`select_tool_parser` picks one from the model: the chat template's markers, then model_type.
"""

from __future__ import annotations

import importlib
from typing import Any

_PARSERS: dict[str, type] = {}
_MODULES = {
    "hermes": "torch_runner.serve.tool_parsers.hermes",
    "llama3_json": "torch_runner.serve.tool_parsers.llama3_json",
    "mistral": "torch_runner.serve.tool_parsers.mistral",
    "openai": "torch_runner.serve.reasoning.harmony",
}
# model_type -> parser, for the families whose format is fixed by the model.
_BY_MODEL_TYPE = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": None,  # Llama 3.x and others share model_type "llama": decided by the template
    "mistral": "mistral",
    "mixtral": "mistral",
    "gpt_oss": "openai",
}
# a marker in the chat template -> parser
_BY_TEMPLATE = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("<|eom_id|>", "llama3_json"),
    ("<|start|>", "openai"),
)
DEFAULT_TOOL_PARSER = "hermes"


def register_tool_parser(name: str):
    """Class decorator: make a parser class available under vLLM's `name`."""

    def decorate(cls: type) -> type:
        _PARSERS[name] = cls
        return cls

    return decorate


def tool_parser_names() -> tuple[str, ...]:
    return tuple(sorted(set(_MODULES) | set(_PARSERS)))


def get_tool_parser(name: str) -> type:
    """The parser class registered under `name` (a ValueError naming the allowed ones if none)."""
    if name not in _PARSERS and name in _MODULES:
        try:
            importlib.import_module(_MODULES[name])
        except ImportError as exc:  # a parser whose module is not part of this build yet
            raise ValueError(f"tool-call parser {name!r} is not available: {exc}") from None
    if name not in _PARSERS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; allowed values: {', '.join(tool_parser_names())}"
        )
    return _PARSERS[name]


def select_tool_parser(model_type: str | None, chat_template: str | None) -> str:
    """vLLM's parser name for a model: markers in its chat template first (a Hermes fine-tune of
    Mistral writes `<tool_call>`), then its model_type, else hermes (the default tool prompt's
    format)."""
    template = chat_template or ""
    for marker, name in _BY_TEMPLATE:
        if marker in template:
            return name
    return _BY_MODEL_TYPE.get(model_type or "") or DEFAULT_TOOL_PARSER


def new_tool_parser(name: str, tokenizer: Any = None) -> Any:
    return get_tool_parser(name)(tokenizer)
