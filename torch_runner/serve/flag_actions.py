"""The argparse actions behind serve/flags.py: aliases that refuse to disagree.

`adder(group)` returns `add(*names, **kwargs)`, which stores through `_Once`: the option string
and value that set each destination are remembered, so two spellings of one setting (`--seed`
and `--random-seed`) with different values raise `FlagConflict` (the CLI prints it in one line,
exit 2) instead of argparse's silent last-one-wins.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


class FlagConflict(Exception):
    """Two spellings of one setting were given with different values."""


class _Once(argparse.Action):
    """`store` (or, with nargs=0, `store_const`) that refuses a conflicting second spelling.

    The option string and value that set each destination are kept on the namespace, so
    `--seed 1 --random-seed 1` passes and `--seed 1 --random-seed 2` is a FlagConflict.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else values
        sources = namespace.__dict__.setdefault("_flag_sources", {})
        previous = sources.get(self.dest)
        if previous is not None and previous[0] != option_string and previous[1] != value:
            raise FlagConflict(
                f"{_shown(option_string, value, self.nargs)} conflicts with "
                f"{_shown(*previous, self.nargs)}: both set {self.dest}; pass only one of them"
            )
        sources[self.dest] = (option_string, value)
        setattr(namespace, self.dest, value)


def _shown(option: str, value: Any, nargs: Any) -> str:
    return option if nargs == 0 else f"{option} {value}"


Adder = Callable[..., argparse.Action]


def adder(group: argparse._ArgumentGroup) -> Adder:
    """`add(*names, **kwargs)`: store flags (and aliases) go through `_Once`."""

    def add(*names: str, **kwargs: Any) -> argparse.Action:
        if kwargs.get("action") in (None, "store"):
            kwargs["action"] = _Once
        return group.add_argument(*names, **kwargs)

    return add


def flag_const(add: Adder, *names: str, dest: str, const: Any, help: str) -> None:
    add(*names, dest=dest, action=_Once, nargs=0, const=const, default=argparse.SUPPRESS, help=help)
