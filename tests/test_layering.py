"""Layering contract (bridge <- ops <- models <- torch_runner) and lazy MLX import.

`make test` runs import-linter over the real tree; these tests prove the check can fail and that no
package drags mlx in while MLX is off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bridge", "ops", "models", "torch_runner")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _copy_tree(tmp_path: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter not installed")
def test_layering_check_passes_on_the_real_tree(tmp_path):
    result = _lint(_copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter not installed")
@pytest.mark.parametrize(
    ("package", "upward"), [("ops", "torch_runner"), ("bridge", "ops"), ("models", "torch_runner")]
)
def test_layering_check_fails_on_an_upward_import(tmp_path, package, upward):
    tree = _copy_tree(tmp_path)
    (tree / package / "_upward.py").write_text(f"import {upward}  # noqa: F401\n")
    result = _lint(tree)
    assert result.returncode != 0
    assert f"{package}._upward" in result.stdout


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter not installed")
@pytest.mark.parametrize(
    ("module", "imported"),
    [
        ("torch_runner/kv", "torch_runner.serve"),  # kv sits below serve
        ("torch_runner/kv", "torch_runner.runner"),  # and below the runner
        ("torch_runner/runner", "torch_runner.engine"),  # the runner never reaches the engine
        ("torch_runner/grammar", "torch_runner.scheduler"),  # grammar and scheduler are siblings
        ("torch_runner/kv/block_manager", "torch"),  # bookkeeping is plain Python
        ("torch_runner/scheduler", "torch"),
        ("torch_runner/engine", "fastapi"),  # HTTP stays in serve
    ],
)
def test_engine_contracts_fail_on_a_forbidden_import(tmp_path, module, imported):
    tree = _copy_tree(tmp_path)
    target = tree / (module + ".py")
    if not target.exists():  # a package: add a module inside it
        target = tree / module / "_forbidden.py"
        target.write_text(f"import {imported}  # noqa: F401\n")
    else:
        target.write_text(target.read_text() + f"\nimport {imported}  # noqa: E402, F401\n")
    result = _lint(tree)
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout


def test_packages_do_not_import_mlx_when_disabled():
    code = (
        "import importlib, pkgutil, sys\n"
        f"for name in {PACKAGES!r}:\n"
        "    pkg = importlib.import_module(name)\n"
        "    for info in pkgutil.walk_packages(pkg.__path__, name + '.'):\n"
        "        leaf = info.name.rsplit('.', 1)[-1]\n"
        "        if leaf == '__main__' or leaf == 'mlx' or '.mlx.' in info.name + '.':\n"
        "            continue\n"
        "        try:\n"
        "            importlib.import_module(info.name)\n"
        "        except ModuleNotFoundError as exc:  # GPU-only kernels need triton\n"
        "            if exc.name != 'triton':\n"
        "                raise\n"
        "loaded = sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.'))\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_RUNNER_")}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
