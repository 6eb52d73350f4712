"""Strings a request may carry only if they can be encoded: no lone UTF-16 surrogates.

JSON allows `"\\ud800"` escapes that decode to a lone surrogate, which Python keeps in a `str`
but UTF-8 cannot encode: the tokenizer, the chat template and the response encoder would each
fail on it with a 500. `check_encodable` runs on every field of every request model (a
pydantic validator on the shared base), so such a string is a 400 naming the field, and a field
another module adds later is covered without any change here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def _find_unencodable(value: Any, path: str = "") -> tuple[str, int] | None:
    """(path inside the value, character index) of the first lone surrogate, or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path, exc.start
        return None
    if isinstance(value, BaseModel):  # validated by its own fields' validators
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _find_unencodable(key, f"{path} key {key!r}") or _find_unencodable(
                item, f"{path}.{key}"
            )
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _find_unencodable(item, f"{path}.{index}")
            if found is not None:
                return found
    return None


def check_encodable(value: Any) -> Any:
    """Return `value`, or raise ValueError locating the lone surrogate (pydantic adds the field)."""
    found = _find_unencodable(value)
    if found is not None:
        where, index = found
        inside = f" (at {where.lstrip('.')})" if where else ""
        raise ValueError(
            f"contains a lone UTF-16 surrogate at character {index}{inside}, which cannot be "
            "encoded as UTF-8; send valid Unicode text"
        )
    return value
