"""ops/registry.py: one table, backend chosen once from the environment, lazy MLX imports."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ops
from bridge import runtime
from ops import registry

ROOT = Path(__file__).resolve().parents[1]
HAS_MLX = importlib.util.find_spec("mlx") is not None


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(runtime.ENV_USE_MLX, raising=False)
    monkeypatch.delenv(registry.ENV_MLX_OPS, raising=False)
    runtime.reset_cache()
    yield
    runtime.reset_cache()
    monkeypatch.delenv(runtime.ENV_USE_MLX, raising=False)
    monkeypatch.delenv(registry.ENV_MLX_OPS, raising=False)
    registry.configure()


def _mlx_on(monkeypatch, mlx_ops: str | None = None):
    monkeypatch.setenv(runtime.ENV_USE_MLX, "1")
    if mlx_ops is not None:
        monkeypatch.setenv(registry.ENV_MLX_OPS, mlx_ops)
    runtime.reset_cache()
    return {name for name, backend in registry.configure().items() if backend == "mlx"}


def test_every_op_has_a_torch_and_an_mlx_path_and_a_public_dispatcher():
    for name, (torch_path, mlx_path) in registry.OPS.items():
        assert torch_path.startswith("ops.") and ":" in torch_path
        assert mlx_path.startswith("ops.") and ":" in mlx_path
        assert callable(getattr(ops, registry.PUBLIC_NAMES[name]))
    assert {"attention", "rms_norm", "sampler", "norm_infer", "modulate", "dit_rope"} <= set(
        registry.OPS
    )


@pytest.mark.parametrize("name", list(registry.OPS))
def test_every_registered_path_resolves_to_a_function(name):
    torch_path, mlx_path = registry.OPS[name]
    assert callable(registry.load(torch_path))
    if HAS_MLX:
        assert callable(registry.load(mlx_path))


def test_mlx_off_routes_everything_to_torch_even_with_mlx_ops_set(monkeypatch, caplog):
    monkeypatch.setenv(registry.ENV_MLX_OPS, "all")
    with caplog.at_level(logging.WARNING, logger="ops"):
        backends = registry.configure()
    assert set(backends.values()) == {"torch"}
    assert "ignored" in caplog.text


@pytest.mark.skipif(not HAS_MLX, reason="needs mlx")
@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, {"attention", "rms_norm", "sampler"}),
        ("attention,rms_norm", {"attention", "rms_norm"}),
        (" layer_norm , moe_qwen3 ", {"layer_norm", "moe_qwen3"}),
        ("all", set(registry.OPS)),
        ("none", set()),
        ("AUTO", set(registry.AUTO_MLX_OPS.get("Linux-x86_64", frozenset()))),
    ],
)
def test_mlx_ops_narrows_or_widens_the_default_set(monkeypatch, raw, expected):
    if raw == "AUTO" and sys.platform != "linux":
        pytest.skip("auto table checked for Linux x86_64 here")
    assert _mlx_on(monkeypatch, raw) == expected


def test_unknown_op_name_is_a_startup_error_listing_valid_names(monkeypatch):
    monkeypatch.setenv(registry.ENV_MLX_OPS, "attention,flash_attn")
    with pytest.raises(
        ValueError, match="unknown op.*flash_attn.*valid names: attention, rms_norm"
    ):
        registry.configure()


def test_backends_are_logged_once_per_configure(caplog):
    with caplog.at_level(logging.INFO, logger="ops"):
        registry.configure()
        for _ in range(3):
            ops.rms_norm(torch.ones(2, 4), None, 1e-6)
            ops.backends()
    assert [r.getMessage() for r in caplog.records].count(
        "ops backends: " + ", ".join(f"{k}=torch" for k in registry.OPS)
    ) == 1


@pytest.mark.skipif(not HAS_MLX, reason="needs mlx")
def test_dispatch_calls_the_chosen_backend_and_imports_mlx_module_only_when_routed(monkeypatch):
    sys.modules.pop("ops.mlx.norm", None)
    assert _mlx_on(monkeypatch, "layer_norm") == {"layer_norm"}
    x, w = torch.randn(3, 8), torch.rand(8)
    ops.rms_norm(x, w, 1e-6)
    assert "ops.mlx.norm" not in sys.modules  # rms_norm stayed on torch
    from bridge import reset_stats, stats

    reset_stats()
    out = ops.layer_norm(x, w, None, 1e-6)
    assert stats().evals == 1 and "ops.mlx.norm" in sys.modules
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (8,), w, None, 1e-6))


def test_import_ops_and_calling_torch_ops_never_imports_mlx():
    code = (
        "import sys, torch, ops\n"
        "ops.configure()\n"
        "ops.rms_norm(torch.ones(2, 4), None, 1e-6)\n"
        "q = torch.randn(1, 2, 3, 4)\n"
        "ops.attention(q, q, q, torch.arange(3)[None], None, sm_scale=0.5)\n"
        "bad = [m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'ops.mlx'))]\n"
        "assert not bad, bad\n"
    )
    env = {k: v for k, v in os.environ.items() if k != runtime.ENV_USE_MLX}
    env[registry.ENV_MLX_OPS] = "all"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
