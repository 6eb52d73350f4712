"""`--help` offers exactly what start-up accepts: every listed dtype and load format passes the
engine's own validation, and anything else is refused by the parser (exit 2) before a model is
touched. New flags of this issue validate their values the same way."""

from __future__ import annotations

import pytest

from models.loader import LOAD_FORMATS
from torch_runner.config import ALLOWED_DTYPES, EngineConfig
from torch_runner.serve.cli import build_parser, main
from torch_runner.serve.flags import DTYPE_ALIASES


def _choices(flag: str) -> tuple[str, ...]:
    action = next(a for a in build_parser()._actions if flag in a.option_strings)
    return tuple(action.choices)


def test_dtype_choices_are_exactly_the_accepted_ones(capsys):
    assert _choices("--dtype") == (*ALLOWED_DTYPES, *DTYPE_ALIASES)  # vLLM's spellings too
    for dtype in ALLOWED_DTYPES:
        EngineConfig(dtype=dtype)  # each one listed is accepted
    for alias, dtype in DTYPE_ALIASES.items():
        assert dtype in ALLOWED_DTYPES, alias
    with pytest.raises(SystemExit) as exit_info:
        main(["--dtype", "float64"])
    assert exit_info.value.code == 2 and "invalid choice: 'float64'" in capsys.readouterr().err


def test_load_format_choices_are_the_loaders(capsys):
    assert _choices("--load-format") == LOAD_FORMATS
    with pytest.raises(SystemExit) as exit_info:
        main(["--load-format", "pickle"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--max-choices-per-request", "0"], "--max-choices-per-request"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
        (["--shutdown-timeout", "nan"], "--shutdown-timeout"),
    ],
)
def test_new_flags_reject_bad_values_naming_them(args, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--model", "/nonexistent/never-read"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and flag in err and "never-read" not in err
