"""The ops' environment switches: one reader, so every switch rejects a bad value the same way
(the variable, the value, the allowed values)."""

from __future__ import annotations

import os


def env_choice(name: str, default: str, choices) -> str:
    """Environment variable `name` (default `default`), stripped and lower-cased, one of
    `choices` (strings), else one ValueError naming the variable and the allowed values."""
    value = os.environ.get(name, default).strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={value!r}: allowed values are {', '.join(choices)}")
    return value
