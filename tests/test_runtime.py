"""The MLX runtime gate: version matrix, missing pieces, device pairing, env parsing."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from bridge import runtime


@pytest.fixture(autouse=True)
def _fresh_gate(monkeypatch):
    runtime.reset_cache()
    monkeypatch.delenv(runtime.ENV_USE_MLX, raising=False)
    yield
    runtime.reset_cache()


def _fake_mlx(monkeypatch, version: str | None = "0.32.4", metal: bool = False) -> None:
    core = types.ModuleType("mlx.core")
    if version is not None:
        core.__version__ = version
    core.metal = types.SimpleNamespace(is_available=lambda: metal)
    pkg = types.ModuleType("mlx")
    pkg.core = core
    monkeypatch.setitem(sys.modules, "mlx", pkg)
    monkeypatch.setitem(sys.modules, "mlx.core", core)


def _hide_mlx(monkeypatch) -> None:
    # A None entry in sys.modules makes `import mlx.core` raise ImportError.
    monkeypatch.setitem(sys.modules, "mlx", None)
    monkeypatch.setitem(sys.modules, "mlx.core", None)


@pytest.mark.parametrize(
    ("torch_version", "mlx_version", "accepted"),
    [
        ("2.13.0", "0.32.0", True),
        ("2.13.1", "0.32.4", True),
        ("2.13.0+cpu", "0.33.0", True),
        ("2.13.0", "1.0.0", True),
        ("2.12.1", "0.32.0", False),
        ("2.14.0", "0.32.0", False),
        ("2.13.0rc1", "0.32.0", False),
        ("2.13.0.dev20260101", "0.32.0", False),
        ("2.13.0", "0.31.2", False),
        ("2.13.0", "0.32.0rc1", False),
        ("2.13.0", "0.33.0.dev0", False),
        ("2.13.0", "not-a-version", False),
        ("2.13.0", None, False),
    ],
)
def test_version_gate_matrix(monkeypatch, torch_version, mlx_version, accepted):
    _fake_mlx(monkeypatch, mlx_version)
    monkeypatch.setattr(torch, "__version__", torch_version)
    monkeypatch.setenv(runtime.ENV_USE_MLX, "1")
    if accepted:
        assert runtime.use_mlx() is True
        return
    with pytest.raises(runtime.MlxRuntimeError) as info:
        runtime.use_mlx()
    message = str(info.value)
    # The message names what was found and how to fix it.
    assert "pip install -e '.[mlx]'" in message
    bad = (
        torch_version
        if not runtime.is_stable_series(torch_version, (2, 13))
        else (mlx_version or "unknown")
    )
    assert str(bad) in message


def test_missing_mlx_names_the_fix(monkeypatch):
    _hide_mlx(monkeypatch)
    monkeypatch.setenv(runtime.ENV_USE_MLX, "1")
    with pytest.raises(
        runtime.MlxRuntimeError, match=r"import mlx.core.*pip install -e '\.\[mlx\]'"
    ):
        runtime.use_mlx()


def test_disabled_gate_never_touches_mlx(monkeypatch):
    _hide_mlx(monkeypatch)
    monkeypatch.setenv(runtime.ENV_USE_MLX, "0")
    assert runtime.use_mlx() is False


def test_use_mlx_is_cached(monkeypatch):
    _fake_mlx(monkeypatch)
    monkeypatch.setenv(runtime.ENV_USE_MLX, "1")
    assert runtime.use_mlx() is True
    monkeypatch.setenv(runtime.ENV_USE_MLX, "0")
    assert runtime.use_mlx() is True  # decided once per process


@pytest.mark.parametrize("raw", ["2", "maybe", "enabled"])
def test_ambiguous_flag_is_rejected(monkeypatch, raw):
    monkeypatch.setenv(runtime.ENV_USE_MLX, raw)
    with pytest.raises(ValueError, match=f"{runtime.ENV_USE_MLX}=.*allowed values"):
        runtime.use_mlx()


def test_mps_needs_metal(monkeypatch):
    _fake_mlx(monkeypatch, metal=False)
    with pytest.raises(runtime.MlxRuntimeError, match="Metal"):
        runtime.validate_device(torch.device("mps"))
    _fake_mlx(monkeypatch, metal=True)
    runtime.validate_device(torch.device("mps"))


def test_cuda_cannot_be_borrowed(monkeypatch):
    _fake_mlx(monkeypatch)
    with pytest.raises(runtime.MlxRuntimeError, match="CUDA.*--device cpu"):
        runtime.validate_device(torch.device("cuda"))


def test_cpu_pairs_with_mlx_cpu_stream(monkeypatch):
    _fake_mlx(monkeypatch)
    runtime.validate_device(torch.device("cpu"))
    with pytest.raises(runtime.MlxRuntimeError, match="meta"):
        runtime.validate_device(torch.device("meta"))


def test_missing_device_check_names_the_fix(monkeypatch):
    _hide_mlx(monkeypatch)
    with pytest.raises(runtime.MlxRuntimeError, match="mlx extra"):
        runtime.validate_device(torch.device("cpu"))


def test_real_install_passes_the_gate(monkeypatch):
    pytest.importorskip("mlx.core")
    monkeypatch.setenv(runtime.ENV_USE_MLX, "1")
    assert runtime.use_mlx() is True
    runtime.validate_device(torch.device("cpu"))
