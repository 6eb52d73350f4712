"""HF `model_type` -> the family module that implements it.

A family module exposes `ModelArgs` (with `from_hf_config` and `REQUIRED_FIELDS`), `Model`
and `sanitize(weights, args)`. Modules are imported on demand so a typo in one family cannot
break loading another.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from models.errors import ModelLoadError

FAMILIES: dict[str, str] = {
    "llama": "models.llama",
    "mistral": "models.llama",
    "qwen2": "models.qwen2",
    "qwen3": "models.qwen3",
    "qwen3_moe": "models.qwen3_moe",
    "gpt_oss": "models.gpt_oss",
    "gemma3_text": "models.gemma3",
}


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def get_family(model_type: object) -> ModuleType:
    """The family module for `model_type`; an unsupported one is an error listing the supported."""
    if model_type not in FAMILIES:
        raise ModelLoadError(
            f"config.json model_type={model_type!r} is not supported; "
            f"supported model types: {', '.join(supported_model_types())}"
        )
    return importlib.import_module(FAMILIES[model_type])
