"""The diffusion ops under the MLX toggles, and the import contract when MLX is off.

MLX runs in a subprocess with TORCH_RUNNER_USE_MLX=1 and TORCH_RUNNER_MLX_OPS naming the
diffusion ops, so the ops table is chosen exactly as at a real start-up. Oracle: the torch
reference ops and the unpatched transformer, within the same bounds as the torch path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIFFUSION_OPS = "norm_infer,modulate,dit_rope"

_MLX_SCRIPT = r"""
import json, torch, ops
from ops.diffusion import dit_rope, modulate, norm_infer, patch
from ops.diffusion.tiny import tiny_flux_pipeline, tiny_sana_transformer, tiny_transformer_inputs

result = {"backends": {k: v for k, v in ops.backends().items() if k in ("norm_infer", "modulate", "dit_rope")}}
g = torch.Generator().manual_seed(0)
def diff(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()

for dtype in (torch.float32, torch.bfloat16):
    tag = str(dtype).removeprefix("torch.")
    x = (torch.randn(2, 9, 64, generator=g) * 3 + 0.5).to(dtype)
    w, b = torch.randn(64, generator=g), torch.randn(64, generator=g)  # fp32 params
    for rms in (False, True):
        result[f"norm_infer/{tag}/rms={rms}"] = diff(ops.norm_infer(x, w, b, 1e-6, rms), norm_infer(x, w, b, 1e-6, rms))
        result[f"norm_infer/{tag}/rms={rms}/no-affine"] = diff(ops.norm_infer(x, None, None, 1e-6, rms), norm_infer(x, None, None, 1e-6, rms))
    shift, scale = torch.randn(2, 64, generator=g).to(dtype), torch.randn(2, 64, generator=g).to(dtype)
    strided = torch.randn(2, 3 * 64, generator=g).to(dtype).chunk(3, dim=1)  # non-contiguous views
    result[f"modulate/{tag}"] = diff(ops.modulate(x, shift, scale), modulate(x, shift, scale))
    result[f"modulate/{tag}/strided"] = diff(ops.modulate(x, strided[0], strided[1]), modulate(x, strided[0], strided[1]))
    q = torch.randn(2, 9, 3, 16, generator=g).to(dtype)
    angles = torch.rand(9, 8, generator=g) * 6
    for inter in (True, False):
        full = angles.repeat_interleave(2, -1) if inter else torch.cat((angles, angles), -1)
        result[f"dit_rope/{tag}/interleaved={inter}"] = diff(
            ops.dit_rope(q, full.cos(), full.sin(), inter, 1), dit_rope(q, full.cos(), full.sin(), inter, 1))

    for name, build in (("flux", lambda: tiny_flux_pipeline().transformer), ("sana", tiny_sana_transformer)):
        model = build().to(dtype)
        inputs = tiny_transformer_inputs(model)
        with torch.no_grad():
            expected = model(**inputs)[0]
            report = patch(model)
            out = model(**inputs)[0]
        result[f"patched/{name}/{tag}"] = diff(out, expected)
        result[f"patched/{name}/backend"] = report.backend
print("RESULT " + json.dumps(result))
"""


def _run(code: str, **env_overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_RUNNER_")}
    env.update(env_overrides)
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_mlx_ops_and_patched_models_match_torch():
    pytest.importorskip("mlx.core")
    pytest.importorskip("diffusers")
    proc = _run(_MLX_SCRIPT, TORCH_RUNNER_USE_MLX="1", TORCH_RUNNER_MLX_OPS=DIFFUSION_OPS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result.pop("backends") == dict.fromkeys(DIFFUSION_OPS.split(","), "mlx")
    assert result.pop("patched/flux/backend") == result.pop("patched/sana/backend") == "mlx"
    for key, err in result.items():
        bound = 1e-5 if "/float32" in key else 2e-2
        assert err <= bound, (key, err, bound)


_IMPORT_SCRIPT = r"""
import sys
import bridge, ops, ops.diffusion, ops.diffusion.patch, ops.diffusion.tiny
print(sorted({m.split(".")[0] for m in sys.modules} & {"mlx", "torch_runner", "models", "diffusers"}))
if len(sys.argv) > 1:
    import torch
    from torch import nn
    model = nn.Sequential(nn.LayerNorm(4))
    report = ops.diffusion.patch(model)
    model(torch.randn(2, 4))
    print(sorted({m.split(".")[0] for m in sys.modules} & {"mlx"}))
    print(report.backend)
"""


def test_ops_import_without_runner_models_diffusers_or_mlx():
    proc = _run(_IMPORT_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["[]"]


def test_mlx_is_imported_only_once_enabled_and_used():
    pytest.importorskip("mlx.core")
    code = _IMPORT_SCRIPT.replace("if len(sys.argv) > 1:", "if True:")
    proc = _run(code, TORCH_RUNNER_USE_MLX="1", TORCH_RUNNER_MLX_OPS="norm_infer")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "[]",
        "['mlx']",
        "norm_infer=mlx, modulate=torch, dit_rope=torch",  # the table's per-op choice
    ]
