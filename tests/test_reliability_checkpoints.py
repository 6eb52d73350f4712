"""Broken checkpoints never reach serving: `python -m torch_runner.serve` prints one line naming
what is wrong (the tensor, the file) and exits 2 before it serves; good weights load unchanged.

Each case damages a private copy of the tiny serving checkpoint the way a bad download, a bad
conversion or a bad merge would, then runs the CLI's `main` in this process (the same code path
as the subprocess, without a 5 s interpreter start per case); one case runs the real subprocess.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from serve_fixtures import REPO_ROOT, save_serve_checkpoint

import models
from models import ModelLoadError
from torch_runner.serve.cli import main

TENSOR = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path, _ = save_serve_checkpoint(tmp_path_factory.mktemp("pristine") / "tiny")
    return path


@pytest.fixture
def ckpt(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "model")


def _edit(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _set(name, make):
    return lambda t: t.update({name: make(t[name])})


def _nan(t):
    t = t.clone()
    t.view(-1)[7] = float("nan")
    return t


def _truncate(path):
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])


def _pickle(path):
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")


def _bad_config(path):
    (path / "config.json").write_text('{"model_type": "llama", ')


def _bad_tokenizer(path):
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "nonsense"}}')


CASES = {
    "truncated_file": (_truncate, "model.safetensors: corrupt or truncated"),
    "missing_tensor": (lambda p: _edit(p, lambda t: t.pop(TENSOR)), TENSOR),
    "wrong_shape": (lambda p: _edit(p, _set(TENSOR, lambda w: w[:-1].clone())), TENSOR),
    "wrong_dtype": (
        lambda p: _edit(p, _set(TENSOR, lambda w: w.to(torch.int32))),
        f"'{TENSOR}' has dtype int32; expected a floating-point",
    ),
    "nan_value": (lambda p: _edit(p, _set(TENSOR, _nan)), f"'{TENSOR}' has 1 non-finite"),
    "inf_value": (
        lambda p: _edit(
            p, _set(TENSOR, lambda w: w.index_fill(0, torch.tensor([3]), -float("inf")))
        ),
        f"'{TENSOR}' has",
    ),
    "bad_config": (_bad_config, "config.json is not valid JSON"),
    "bad_tokenizer": (_bad_tokenizer, "cannot load the tokenizer"),
    "pickle_file": (_pickle, "never unpickles"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_checkpoint_exits_2_with_one_line(ckpt, case, capsys):
    damage, expected = CASES[case]
    damage(ckpt)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(ckpt), "--device", "cpu", "--port", "0", "--log-level", "error"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("Loading")]  # tqdm, when a tty
    assert len(err) == 1, err
    assert expected in err[0] and err[0].startswith("error: "), err[0]


def test_fp16_overflow_is_caught_after_the_cast(ckpt):
    """A finite fp32 value past fp16's range becomes inf when served as float16: refused there."""
    _edit(ckpt, _set(TENSOR, lambda w: w.index_fill(0, torch.tensor([0]), 1e6)))
    assert models.load_model(ckpt, device="cpu", dtype="float32") is not None
    with pytest.raises(ModelLoadError, match=f"'{TENSOR}' has 64 non-finite value\\(s\\).*float16"):
        models.load_model(ckpt, device="cpu", dtype="float16")


def test_good_weights_load_bit_identical(pristine):
    """The checks change nothing: every loaded tensor equals the file's."""
    loaded = models.load_model(pristine, device="cpu", dtype="float32")
    state = loaded.model.state_dict()
    for name, tensor in load_file(str(pristine / "model.safetensors")).items():
        if name in state:
            assert torch.equal(state[name], tensor), name


def test_subprocess_exit_code_is_2_before_serving(ckpt):
    _edit(ckpt, _set(TENSOR, _nan))
    done = subprocess.run(
        [sys.executable, "-m", "torch_runner.serve", "--model", str(ckpt), "--device", "cpu",
         "--port", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and TENSOR in lines[0], done.stderr
    assert "Traceback" not in done.stderr and "listening" not in done.stdout
