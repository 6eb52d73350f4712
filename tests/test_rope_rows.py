"""The static decode's rope rows (models/layers.py `Rotary.covering`): gathered from a table
built once must equal `rope_tables` computed per step bit for bit (each row is an elementwise
function of its position), for every rope kind the loader builds, and grow without dropping a
table a captured graph may still read. The placeholder swap of chained steps in place
(torch_runner/runner/launched.py `resolve_placeholders_`) against the torch expression."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import LlamaConfig

from models.layers import Rotary
from models.llama import ModelArgs
from ops.rope import rope_tables
from torch_runner.runner.launched import placeholder, resolve_placeholders, resolve_placeholders_

PARAMS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
             "beta_slow": 1.0, "original_max_position_embeddings": 4096},
}  # fmt: skip


def _rotary(kind: str, head_dim: int = 64, **extra) -> Rotary:
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=head_dim, max_position_embeddings=131072,
                         rope_parameters=dict(PARAMS[kind]), **extra)  # fmt: skip
    return Rotary(ModelArgs.from_hf_config(config.to_dict()))


@pytest.mark.parametrize("kind", sorted(PARAMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_covered_rows_equal_rope_tables_bit_for_bit(kind, dtype):
    rotary = _rotary(kind)
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 512, (3, 1), generator=gen)
    want_cos, want_sin = rope_tables(positions, rotary.inv_freq, rotary.attention_scaling, dtype)
    rotary.covering = 512
    got = rotary.at(positions, dtype)
    assert got.cos.shape == want_cos.shape and got.sin.shape == want_sin.shape
    assert torch.equal(got.cos, want_cos) and torch.equal(got.sin, want_sin)
    assert len(rotary._tables) == 1 and rotary._tables[0].shape[0] == 512


def test_partial_rotary_rows_and_the_rotation_they_give():
    """Partial rotary (D_rot < D): the rows and the rotated q are those of the per-step path."""
    rotary = _rotary("default", head_dim=64, partial_rotary_factor=0.5)
    positions = torch.tensor([[0], [7], [300]])
    q = torch.randn(3, 1, 4, 64).bfloat16()
    want = rotary.at(positions, torch.bfloat16)(q)
    rotary.covering = 512
    got_at = rotary.at(positions, torch.bfloat16)
    assert got_at.cos.shape[-1] == 32 and rotary._tables  # the table path was taken
    assert torch.equal(got_at(q), want)


def test_tables_grow_and_keep_every_earlier_table():
    rotary = _rotary("llama3")
    rotary.covering = 64
    first = rotary.at(torch.tensor([[5]]), torch.float32)
    rotary.covering = 256  # a longer key bucket: a larger table, the first one kept
    second = rotary.at(torch.tensor([[200]]), torch.float32)
    assert [t.shape[0] for t in rotary._tables] == [64, 256]
    rotary.covering = 100  # covered by the larger table: nothing new
    rotary.at(torch.tensor([[99]]), torch.float32)
    assert len(rotary._tables) == 2
    want = rope_tables(torch.tensor([[5], [200]]), rotary.inv_freq, rotary.attention_scaling,
                       torch.float32)  # fmt: skip
    assert torch.equal(torch.cat([first.cos, second.cos]), want[0])
    assert torch.equal(torch.cat([first.sin, second.sin]), want[1])


def test_uncovered_forward_computes_the_rows():
    rotary = _rotary("default")
    rotary.at(torch.tensor([[100000]]), torch.float32)  # any position: no table
    assert rotary._tables == []


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_resolve_placeholders_in_place_equals_the_torch_expression(dtype):
    future = torch.tensor([11, 22, 33, 44], dtype=torch.int64)
    buffer = torch.tensor([[5, 0], [placeholder(2), 1], [7, 2], [placeholder(0), 3]], dtype=dtype)
    want = resolve_placeholders(buffer[:, 0].clone(), future)
    resolve_placeholders_(buffer[:, 0], future)  # a strided column, as in the graph inputs
    assert buffer[:, 0].tolist() == want.tolist() == [5, 33, 7, 11]
    assert buffer[:, 1].tolist() == [0, 1, 2, 3]  # the other column untouched


HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()


def check_resolve_kernel(device: str) -> None:
    """The Triton placeholder swap on strided columns equals the torch expression."""
    from ops.fused.triton_kernels import resolve_placeholders_ as kernel

    gen = torch.Generator().manual_seed(0)
    for rows in (1, 3, 17, 64):
        future = torch.randint(0, 50000, (rows + 2,), generator=gen)
        ids = torch.randint(0, 50000, (rows,), generator=gen)
        chained = torch.rand(rows, generator=gen) < 0.5
        ids[chained] = -torch.randint(1, rows + 3, (int(chained.sum()),), generator=gen)
        buffer = torch.full((rows, 5), 9, dtype=torch.int64)
        buffer[:, 0] = ids
        buffer, future = buffer.to(device), future.to(device)
        want = resolve_placeholders(buffer[:, 0].clone(), future)
        kernel(buffer[:, 0], future)
        assert torch.equal(buffer[:, 0], want), (rows, buffer[:, 0], want)
        assert bool((buffer[:, 1:] == 9).all())


@pytest.mark.skipif(HAS_CUDA or not HAS_TRITON, reason="CPU interpreter check")
def test_resolve_kernel_equals_the_torch_expression_in_the_interpreter():
    from triton_interpreter import assert_interpreter_ok

    script = "from test_rope_rows import check_resolve_kernel\ncheck_resolve_kernel('cpu')\n"
    assert_interpreter_ok(script + "print('ok')\n", timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_resolve_kernel_and_covered_rows():
    check_resolve_kernel("cuda")
    for kind in sorted(PARAMS):
        rotary = _rotary(kind).cuda()
        positions = torch.randint(0, 4096, (8, 1), device="cuda")
        want = rope_tables(positions, rotary.inv_freq, rotary.attention_scaling, torch.bfloat16)
        rotary.covering = 4096
        got = rotary.at(positions, torch.bfloat16)
        assert torch.equal(got.cos, want[0]) and torch.equal(got.sin, want[1])
