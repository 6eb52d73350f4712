"""ops.rope against transformers: the rope init formulas and the rotary application."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.llama import modeling_llama

from ops.rope import apply_rope, rope_init, rope_tables, rotate

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
YARN_TRUNCATED = {**YARN, "truncate": True, "factor": 4.0}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


def _llama_config(rope_parameters, head_dim=64, **extra):
    return LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=dict(rope_parameters),
        **extra,
    )


def _hf_inv_freq(config):
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


@pytest.mark.parametrize(
    "params",
    [DEFAULT, LINEAR, LLAMA3, YARN, YARN_TRUNCATED],
    ids=["default", "linear", "llama3", "yarn", "yarn_truncated"],
)
def test_rope_init_equals_transformers_rope_init_functions(params):
    ours, our_scale = rope_init(_llama_config(params))
    want, want_scale = _hf_inv_freq(_llama_config(params))
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(want_scale, rel=1e-12)


def test_rope_init_partial_rotary_factor_halves_the_frequencies():
    # transformers' Llama default init ignores partial_rotary_factor; its scaled inits honour it
    config = _llama_config({**LINEAR, "partial_rotary_factor": 0.5})
    ours, _ = rope_init(config)
    want, _ = _hf_inv_freq(config)
    assert ours.shape == (16,)
    torch.testing.assert_close(ours, want)


def test_rope_init_unknown_type_lists_allowed_values():
    config = _llama_config(DEFAULT)
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 1.0}
    with pytest.raises(ValueError, match="rope_type='longrope'.*allowed values: default"):
        rope_init(config)


def _positions():
    return torch.tensor([[0, 1, 2, 3, 4], [100, 101, 102, 4000, 9]])  # [B, N], absolute


@pytest.mark.parametrize("params", [DEFAULT, LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_equals_llama_rotary_embedding(params, dtype):
    config = _llama_config(params)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 64, generator=gen).to(dtype)
    k = torch.randn(2, 2, 5, 64, generator=gen).to(dtype)
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    cos, sin = rotary(q, _positions())
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    inv_freq, scale = rope_init(config)
    got_q, got_k = apply_rope(q, k, _positions(), inv_freq, scale)
    assert got_q.dtype == dtype
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)


def test_apply_rope_equals_gpt_oss_yarn_rotary_embedding():
    config = GptOssConfig(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=128
    )
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 5, 64, generator=gen)
    k = torch.randn(2, 2, 5, 64, generator=gen)
    rotary = modeling_gpt_oss.GptOssRotaryEmbedding(config)
    assert rotary.attention_scaling != 1.0  # yarn scales cos/sin: the test covers it
    cos, sin = rotary(q, _positions())
    want_q, want_k = modeling_gpt_oss.apply_rotary_pos_emb(q, k, cos, sin)
    inv_freq, scale = rope_init(config)
    got_q, got_k = apply_rope(q, k, _positions(), inv_freq, scale)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


def test_apply_rope_partial_rotary_leaves_the_tail_untouched():
    config = _llama_config({**DEFAULT, "partial_rotary_factor": 0.5})
    inv_freq, scale = rope_init(config)
    q = torch.randn(2, 4, 5, 64)
    got_q, _ = apply_rope(q, q[:, :2], _positions(), inv_freq, scale)
    torch.testing.assert_close(got_q[..., 32:], q[..., 32:], rtol=0, atol=0)
    full, _ = apply_rope(q[..., :32], q[:, :2, :, :32], _positions(), inv_freq, scale)
    torch.testing.assert_close(got_q[..., :32], full)


def test_apply_rope_rejects_positions_of_the_wrong_shape():
    inv_freq, scale = rope_init(_llama_config(DEFAULT))
    q = torch.randn(2, 4, 5, 64)
    with pytest.raises(ValueError, match=r"positions must be \[B, N\]"):
        apply_rope(q, q, torch.zeros(2, 4, dtype=torch.long), inv_freq, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dims", [16, 8])  # full and partial rotary (head_dim 16)
def test_rope_tables_rotate_is_bit_identical_to_apply_rope(dtype, rotary_dims):
    """The once-per-forward tables + flip rotation change no value of the per-layer op."""
    gen = torch.Generator().manual_seed(7)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dims, 2).float() / rotary_dims))
    q = torch.randn(2, 4, 5, 16, generator=gen).to(dtype)  # [B, Hq, N, D]
    k = torch.randn(2, 2, 5, 16, generator=gen).to(dtype)  # [B, Hkv, N, D]
    positions = torch.randint(0, 4096, (2, 5), generator=gen)
    want_q, want_k = apply_rope(q, k, positions, inv_freq, 1.25)
    cos, sin = rope_tables(positions, inv_freq, 1.25, dtype)  # [B, N, 1, D_rot]
    got_q = rotate(q.transpose(1, 2), cos, sin).transpose(1, 2)
    got_k = rotate(k.transpose(1, 2), cos, sin).transpose(1, 2)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
