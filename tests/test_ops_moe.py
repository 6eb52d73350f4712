"""ops.moe against transformers' gpt-oss and Qwen3-MoE blocks on tiny random weights."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from ops.moe import moe_gpt_oss, moe_qwen3


def _randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return module


@pytest.mark.parametrize("num_tokens", [1, 13])
def test_moe_gpt_oss_equals_transformers_gpt_oss_mlp(num_tokens):
    config = GptOssConfig(
        hidden_size=32, intermediate_size=24, num_local_experts=8, num_experts_per_tok=3
    )
    block = _randomize(GptOssMLP(config), seed=num_tokens)
    x = torch.randn(1, num_tokens, 32, generator=torch.Generator().manual_seed(7)) * 2
    want, _ = block(x)
    got = moe_gpt_oss(
        x[0],
        block.router.weight,
        block.router.bias,
        block.experts.gate_up_proj,
        block.experts.gate_up_proj_bias,
        block.experts.down_proj,
        block.experts.down_proj_bias,
        top_k=3,
        limit=config.swiglu_limit,
        alpha=config.swiglu_alpha,
    )
    # the clamp at 7.0 must actually bind for this test to cover it
    gate_up = x[0] @ block.experts.gate_up_proj[0] + block.experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > 7.0).any()
    torch.testing.assert_close(got, want[0].detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_moe_qwen3_equals_transformers_sparse_moe_block(norm_topk_prob, num_tokens):
    config = Qwen3MoeConfig(
        hidden_size=32,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
    )
    block = _randomize(Qwen3MoeSparseMoeBlock(config), seed=num_tokens)
    x = torch.randn(1, num_tokens, 32, generator=torch.Generator().manual_seed(3))
    want = block(x)
    got = moe_qwen3(
        x[0],
        block.gate.weight,
        block.experts.gate_up_proj,
        block.experts.down_proj,
        top_k=2,
        norm_topk_prob=norm_topk_prob,
    )
    torch.testing.assert_close(got, want[0].detach(), rtol=1e-5, atol=1e-5)


def test_moe_rejects_bad_top_k_and_rank():
    weight = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\]"):
        moe_qwen3(
            torch.zeros(2, 8),
            weight,
            torch.zeros(4, 6, 8),
            torch.zeros(4, 8, 3),
            top_k=5,
            norm_topk_prob=True,
        )
    with pytest.raises(ValueError, match=r"x must be \[T, H\]"):
        moe_qwen3(
            torch.zeros(1, 2, 8),
            weight,
            torch.zeros(4, 6, 8),
            torch.zeros(4, 8, 3),
            top_k=1,
            norm_topk_prob=True,
        )
