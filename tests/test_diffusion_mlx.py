"""The diffusion ops under the MLX toggles, and the import contract when MLX is off.

MLX cases set TORCH_RUNNER_USE_MLX=1 and TORCH_RUNNER_MLX_OPS (naming the diffusion ops), reset
the runtime gate and re-run the ops table's start-up choice, so routing is exactly what a real
start-up picks; the fixture restores the table afterwards. Oracle: the torch reference ops and
the unpatched transformer, within the torch path's bounds (fp32 1e-5, bf16 2e-2). Import
contracts run in fresh subprocesses, where sys.modules tells the truth.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ops
from bridge.runtime import reset_cache
from ops import registry
from ops.diffusion import dit_rope, modulate, norm_infer, patch
from ops.diffusion.tiny import tiny_flux_pipeline, tiny_sana_transformer, tiny_transformer_inputs

ROOT = Path(__file__).resolve().parents[1]
DIFFUSION_OPS = "norm_infer,modulate,dit_rope"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture
def mlx_diffusion_ops(monkeypatch):
    pytest.importorskip("mlx.core")
    monkeypatch.setenv("TORCH_RUNNER_USE_MLX", "1")
    monkeypatch.setenv("TORCH_RUNNER_MLX_OPS", DIFFUSION_OPS)
    reset_cache()
    registry.configure()
    yield
    monkeypatch.undo()
    reset_cache()
    registry.configure()


def _assert_same(out, expected, dtype):
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=0)


def test_toggles_route_the_diffusion_ops_to_mlx(mlx_diffusion_ops):
    chosen = ops.backends()
    assert {name: chosen[name] for name in DIFFUSION_OPS.split(",")} == dict.fromkeys(
        DIFFUSION_OPS.split(","), "mlx"
    )
    assert ops.norm_infer is not norm_infer  # the dispatcher, not the torch reference


@DTYPES
@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("has_affine", [False, True])
def test_mlx_norm_infer_matches_torch(mlx_diffusion_ops, dtype, is_rms_norm, has_affine):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 9, 64, generator=generator) * 3 + 0.5).to(dtype)
    weight = torch.randn(64, generator=generator) if has_affine else None  # fp32 params
    bias = torch.randn(64, generator=generator) if has_affine else None
    expected = norm_infer(x, weight, bias, 1e-6, is_rms_norm)
    _assert_same(ops.norm_infer(x, weight, bias, 1e-6, is_rms_norm), expected, dtype)


@DTYPES
def test_mlx_modulate_matches_torch_including_strided_views(mlx_diffusion_ops, dtype):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 64, generator=generator).to(dtype)
    # Flux hands over chunks of one [B, 6 * D] tensor: non-contiguous [B, D] views.
    shift, scale, _ = torch.randn(2, 3 * 64, generator=generator).to(dtype).chunk(3, dim=1)
    _assert_same(ops.modulate(x, shift, scale), modulate(x, shift, scale), dtype)
    table = torch.randn(2, 1, 64, generator=generator).to(dtype)
    _assert_same(ops.modulate(x, table, table), modulate(x, table, table), dtype)


@DTYPES
@pytest.mark.parametrize("is_interleaved", [True, False])
def test_mlx_dit_rope_matches_torch(mlx_diffusion_ops, dtype, is_interleaved):
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 9, 3, 16, generator=generator).to(dtype)  # [B, S, H, D]
    angles = torch.rand(9, 8, generator=generator) * 6
    full = angles.repeat_interleave(2, -1) if is_interleaved else torch.cat((angles, angles), -1)
    cos, sin = full.cos(), full.sin()
    expected = dit_rope(q, cos, sin, is_interleaved, 1)
    _assert_same(ops.dit_rope(q, cos, sin, is_interleaved, 1), expected, dtype)


@DTYPES
@pytest.mark.parametrize("family", ["flux", "sana"])
def test_patched_transformer_on_mlx_matches_unpatched(mlx_diffusion_ops, family, dtype):
    pytest.importorskip("diffusers")
    if family == "flux":
        model = tiny_flux_pipeline(num_layers=1, num_single_layers=1).transformer
    else:
        model = tiny_sana_transformer(num_layers=1)
    model.to(dtype)
    inputs = tiny_transformer_inputs(model)
    with torch.no_grad():
        expected = model(**inputs)[0]
        report = patch(model)  # backend from the table: the toggles above
        out = model(**inputs)[0]
    assert report.backend == "mlx"
    _assert_same(out, expected, dtype)


def _run(code: str, **env_overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_RUNNER_")}
    env.update(env_overrides)
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


_LOADED = 'print(sorted({m.split(".")[0] for m in sys.modules} & {"mlx", "torch_runner", "models", "diffusers"}))\n'
_IMPORT_SCRIPT = (
    "import sys\nimport bridge, ops, ops.diffusion, ops.diffusion.patch, ops.diffusion.tiny\n"
    + _LOADED
)
_PATCH_SCRIPT = (
    _IMPORT_SCRIPT
    + "import torch\nmodel = torch.nn.Sequential(torch.nn.LayerNorm(4))\n"
    + "report = ops.diffusion.patch(model)\nmodel(torch.randn(2, 4))\n"
    + _LOADED
    + "print(report.backend)\n"
)


def test_ops_import_without_runner_models_diffusers_or_mlx():
    proc = _run(_IMPORT_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["[]"]


def test_mlx_is_imported_only_once_enabled_and_used():
    pytest.importorskip("mlx.core")
    proc = _run(_PATCH_SCRIPT, TORCH_RUNNER_USE_MLX="1", TORCH_RUNNER_MLX_OPS="norm_infer")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "[]",
        "['mlx']",
        "norm_infer=mlx, modulate=torch, dit_rope=torch",  # the table's per-op choice
    ]
