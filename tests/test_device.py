"""Device resolution: auto = mps > cuda > cpu; unavailable explicit devices are errors."""

from __future__ import annotations

import pytest
import torch

from bridge import device as device_mod
from bridge.device import resolve_device


def _fake_availability(monkeypatch, mps: bool, cuda: bool) -> None:
    monkeypatch.setattr(device_mod, "_mps_available", lambda: mps)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if cuda else 0)


@pytest.mark.parametrize(
    ("mps", "cuda", "expected"),
    [(True, True, "mps"), (False, True, "cuda"), (False, False, "cpu"), (True, False, "mps")],
)
def test_auto_prefers_mps_then_cuda_then_cpu(monkeypatch, mps, cuda, expected):
    _fake_availability(monkeypatch, mps, cuda)
    assert resolve_device("auto").type == expected


def test_explicit_unavailable_device_is_an_error(monkeypatch):
    _fake_availability(monkeypatch, mps=False, cuda=False)
    with pytest.raises(ValueError, match="'cuda'.*not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="'mps'.*not available"):
        resolve_device("mps")


def test_cuda_index_out_of_range(monkeypatch):
    _fake_availability(monkeypatch, mps=False, cuda=True)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="only 1 CUDA device"):
        resolve_device("cuda:3")


def test_unknown_device_lists_allowed_values():
    with pytest.raises(ValueError, match="allowed values: auto, mps, cuda, cpu"):
        resolve_device("tpu")


def test_cpu_is_always_available():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
