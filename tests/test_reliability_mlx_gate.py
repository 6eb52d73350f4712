"""`Engine(...)` applies the MLX gate before it reads anything of the model, like `serve`: with
TORCH_RUNNER_USE_MLX=1 a bad flag, a broken runtime or an unusable device fails first, naming
the MLX problem and never the (here missing) model folder."""

from __future__ import annotations

import pytest

import bridge.runtime as runtime
from bridge import MlxRuntimeError
from torch_runner import Engine

MISSING_MODEL = "/nonexistent/model-folder"


@pytest.fixture
def mlx_env(monkeypatch):
    """Sets TORCH_RUNNER_USE_MLX with the gate's cached verdicts cleared before and after."""

    def set_flag(value: str) -> None:
        monkeypatch.setenv("TORCH_RUNNER_USE_MLX", value)
        runtime.reset_cache()

    yield set_flag
    runtime.reset_cache()


def test_bad_flag_fails_before_the_model(mlx_env):
    mlx_env("maybe")
    with pytest.raises(ValueError, match="TORCH_RUNNER_USE_MLX") as err:
        Engine(MISSING_MODEL, device="cpu")
    assert MISSING_MODEL not in str(err.value)


def test_broken_runtime_fails_before_the_model(mlx_env, monkeypatch):
    mlx_env("1")

    def broken():
        raise MlxRuntimeError("mlx is not importable (simulated)")

    monkeypatch.setattr(runtime, "_import_mlx", broken)
    with pytest.raises(MlxRuntimeError, match="simulated"):
        Engine(MISSING_MODEL, device="cpu")


def test_unusable_device_fails_before_the_model(mlx_env):
    mlx_env("1")
    with pytest.raises((MlxRuntimeError, ValueError)) as err:
        Engine(MISSING_MODEL, device="cuda")
    assert "cuda" in str(err.value).lower() and MISSING_MODEL not in str(err.value)


def test_gate_passes_on_cpu_then_the_model_is_resolved(mlx_env):
    mlx_env("1")
    with pytest.raises(ValueError, match="nonexistent"):
        Engine(MISSING_MODEL, device="cpu")
