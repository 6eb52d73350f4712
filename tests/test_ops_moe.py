"""ops.moe against transformers' gpt-oss and Qwen3-MoE blocks on tiny random weights."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import ops.moe as moe_ops
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


def _gpt_oss_case(num_tokens, device="cpu"):
    config = GptOssConfig(
        hidden_size=32, intermediate_size=24, num_local_experts=8, num_experts_per_tok=3
    )
    block = _randomize(GptOssMLP(config), seed=num_tokens).to(device)
    x = (torch.randn(1, num_tokens, 32, generator=torch.Generator().manual_seed(7)) * 2).to(device)
    ex = block.experts
    args = (x[0], block.router.weight, block.router.bias, ex.gate_up_proj, ex.gate_up_proj_bias,
            ex.down_proj, ex.down_proj_bias)  # fmt: skip
    return block(x)[0][0].detach(), args, dict(top_k=3, limit=7.0, alpha=1.702)


def _qwen3_case(num_tokens, device="cpu"):
    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
    block = _randomize(Qwen3MoeSparseMoeBlock(config), seed=num_tokens).to(device)
    x = torch.randn(1, num_tokens, 32, generator=torch.Generator().manual_seed(3)).to(device)
    args = (x[0], block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
    return block(x)[0].detach(), args, dict(top_k=2, norm_topk_prob=True)


CASES = {"gpt_oss": (_gpt_oss_case, moe_gpt_oss), "qwen3": (_qwen3_case, moe_qwen3)}


@pytest.mark.skipif(not moe_ops.HAS_GROUPED_MM, reason="torch without _grouped_mm")
@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("num_tokens", [1, 13, 40])
def test_grouped_experts_equal_transformers(monkeypatch, family, num_tokens):
    """The host-sync-free formulation (CUDA's) on CPU: same function as the HF block."""
    make, op = CASES[family]
    want, args, kwargs = make(num_tokens)
    calls = []

    def grouped(*a, **k):
        calls.append(1)
        return moe_ops._grouped_experts(*a, **k)

    monkeypatch.setattr(moe_ops, "_experts_for", lambda x: grouped)
    got = op(*args, **kwargs)
    assert calls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_dense_experts_equal_transformers(monkeypatch, family, num_tokens):
    """The every-expert formulation (CUDA, non-bf16) on CPU: same function as the HF block."""
    make, op = CASES[family]
    want, args, kwargs = make(num_tokens)
    monkeypatch.setattr(moe_ops, "_experts_for", lambda x: moe_ops._dense_experts)
    torch.testing.assert_close(op(*args, **kwargs), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(CASES))
def test_cuda_moe_equals_the_loop_and_replays_in_a_graph(monkeypatch, family, dtype):
    """CUDA (grouped GEMMs for bf16, dense for fp32) against the reference loop on the same
    device and dtype, then captured in a CUDA graph and replayed on new inputs."""
    make, op = CASES[family]
    _, args, kwargs = make(13, device="cuda")
    args = tuple(a.detach().to(dtype) for a in args)
    assert moe_ops.is_capturable(torch.device("cuda"))
    with torch.no_grad():
        got = op(*args, **kwargs)
        with monkeypatch.context() as m:
            m.setattr(moe_ops, "_experts_for", lambda x: moe_ops._looped_experts)
            want = op(*args, **kwargs)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(
            got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item()
        )
        # eager CUDA linears pad rows to a bucket (ops/linear.py), a different GEMM than the
        # capture's F.linear: bf16 router logits may then round apart and flip near-tied experts,
        # so the replay is compared with eager under the capture's formulation
        monkeypatch.setattr(sys.modules["ops.linear"], "_linear_eager_cuda", F.linear)
        graph = torch.cuda.CUDAGraph()
        op(*args, **kwargs)  # warm-up off the capture
        with torch.cuda.graph(graph):  # a host sync inside would raise here
            out = op(*args, **kwargs)
        args[0].mul_(0.5)  # new routing for the same buffers
        graph.replay()
        torch.testing.assert_close(out, op(*args, **kwargs), rtol=1e-5, atol=1e-5)
