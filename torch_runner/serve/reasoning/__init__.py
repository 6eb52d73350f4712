"""serve.reasoning: reasoning parsers (`<think>` models, gpt-oss harmony channels), a registry by vLLM's
parser names. Pure text/token parsing over serve.parsing: imports no engine, runner or torch."""

from __future__ import annotations

from typing import Any

from torch_runner.serve.parsing import OutputParser
from torch_runner.serve.reasoning.harmony import HarmonyParser
from torch_runner.serve.reasoning.think import ThinkParser, prompt_opens_think

HARMONY_PARSER = "openai_gptoss"
# vLLM's --reasoning-parser names -> does output always start inside the reasoning?
THINK_PARSERS = {"qwen3": False, "deepseek_r1": True}
REASONING_PARSERS = (*THINK_PARSERS, HARMONY_PARSER)


def new_reasoning_parser(
    name: str,
    tokenizer: Any = None,
    *,
    prompt_text: str = "",
    harmony_encoding: Any = None,
    stop: list[str] | None = None,
    include_stop_str: bool = False,
) -> OutputParser:
    """A fresh parser for one choice. `prompt_text`: the rendered prompt (did it open `<think>`?);
    the harmony parser takes the encoding (or loads it from the model's `tokenizer`) and the
    request's `stop` strings (it reads tokens, which the engine's text cut does not reach)."""
    if name == HARMONY_PARSER:
        return HarmonyParser(
            tokenizer, encoding=harmony_encoding, stop=stop, include_stop_str=include_stop_str
        )
    if name not in THINK_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; allowed: {', '.join(REASONING_PARSERS)}"
        )
    return ThinkParser(THINK_PARSERS[name] or prompt_opens_think(prompt_text))
