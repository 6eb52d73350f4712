"""`--generation-config auto|vllm|PATH`: the sampling defaults a request leaves unset.

As vLLM's `--generation-config auto` does, the model author's `generation_config.json` supplies
temperature, top_p, top_k, min_p and repetition_penalty for every request that omits them (a
request's own value always wins, including an explicit 0); `vllm` keeps the neutral defaults
(temperature 1, no filtering). Like vLLM, `do_sample` is not consulted: a value that is present
is applied. The defaults are validated once at start-up (a bad value is one line naming the
file and the field), printed in the banner and reported by `/v1/models`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
NEUTRAL_MODE = "vllm"
AUTO_MODE = "auto"


@dataclass(frozen=True)
class SamplingDefaults:
    """Request-field defaults and where they came from (for the banner and /v1/models)."""

    values: dict[str, Any] = field(default_factory=dict)
    source: str = "neutral"

    def describe(self) -> str:
        if not self.values:
            return f"neutral ({self.source})"
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return f"{shown} ({self.source})"


def generation_config_file(mode: str, model_path: str | Path | None) -> Path | None:
    """The generation_config.json to read for `mode`, or None (neutral defaults).

    auto: the model folder's (or, for a .gguf file, the one beside it), if there is one.
    PATH: a folder holding generation_config.json, or the JSON file itself; it must exist.
    """
    if mode == NEUTRAL_MODE:
        return None
    if mode == AUTO_MODE:
        if model_path is None:
            return None
        folder = Path(model_path)
        candidate = (folder if folder.is_dir() else folder.parent) / GENERATION_CONFIG_FILE
        return candidate if candidate.is_file() else None
    path = Path(mode).expanduser()
    candidate = path / GENERATION_CONFIG_FILE if path.is_dir() else path
    if not candidate.is_file():
        raise ValueError(
            f"--generation-config {mode}: no such file or folder with a {GENERATION_CONFIG_FILE}; "
            f"allowed: auto, vllm or a path"
        )
    return candidate


def load_sampling_defaults(mode: str, model_path: str | Path | None, params_cls: type):
    """Read and validate the defaults; ValueError in one line on a bad file or value."""
    path = generation_config_file(mode, model_path)
    if path is None:
        source = "--generation-config vllm" if mode == NEUTRAL_MODE else "no generation_config.json"
        return SamplingDefaults(source=source)
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--generation-config: {path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--generation-config: {path} must hold a JSON object")
    values = {key: raw[key] for key in SAMPLING_KEYS if raw.get(key) is not None}
    try:
        params_cls(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--generation-config: {path}: {exc}") from None
    return SamplingDefaults(values=values, source=str(path))
