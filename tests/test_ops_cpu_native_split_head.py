"""The fp32 lm_head as two 16-bit planes (ops/cpu_native/split_head.py, head_kernels.cpp): the planes
hold the fp32 weight bit for bit, the product is the fp32 product (fp64 oracle), and the screened
greedy pick is the first maximum of that product in every case, ties and near-ties included,
or None where it cannot decide (then the runner computes the logits)."""

from __future__ import annotations

import pytest
import torch

from ops.cpu_native import build
from ops.cpu_native.split_head import NativeSplitHeadWeight

pytestmark = pytest.mark.skipif(not build.has_avx2(), reason="the native kernels need AVX2 + FMA")


@pytest.fixture(scope="module")
def lib():
    ops = build.native_ops()
    if ops is None:
        pytest.skip("the native library did not build here")
    return ops


def first_max(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Brute force: per row the lowest index holding the maximum of the first `vocab` columns."""
    out = []
    for row in logits[:, :vocab]:
        out.append(int((row == row.max()).nonzero()[0]))
    return torch.tensor(out)


def test_planes_hold_the_weight_bit_for_bit():
    torch.manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (64, 32), dtype=torch.int64).to(torch.int32)
    w = bits.view(torch.float32)  # every bit pattern: NaNs, infinities, subnormals, -0.0
    head = NativeSplitHeadWeight(w)
    assert torch.equal(head.dequantize().view(torch.int32), bits)
    ids = torch.tensor([[0, 63, 5], [17, 17, 2]])
    assert torch.equal(head.rows(ids).view(torch.int32), bits[ids])
    assert not head.can_screen  # non-finite weights: no bound, no screening


def test_product_is_the_fp32_product(lib):
    torch.manual_seed(1)
    w, x = torch.randn(256, 576) * 0.05, torch.randn(5, 576) * 3
    head = NativeSplitHeadWeight(w)
    got = head.linear(x, None)
    want = x.double() @ w.double().T
    gamma = 578 * 2.0**-24  # a 576-term fp32 dot product's relative error bound
    scale = x.double().abs() @ w.double().abs().T
    assert ((got.double() - want).abs() <= gamma * scale).all()
    # one row at a time (the planes read directly) and five (each block rebuilt once): the same bits
    assert torch.equal(torch.cat([head.linear(x[i : i + 1], None) for i in range(5)]), got)
    bias, residual = torch.randn(256), torch.randn(5, 256)
    with_extras = lib.split_linear(x, head.hi, head.lo, bias, residual)
    torch.testing.assert_close(with_extras, got + bias + residual, rtol=1e-6, atol=1e-6)
    many = torch.randn(80, 576)  # past the kernel's row limit: MKL on the rebuilt weight
    torch.testing.assert_close(head.linear(many, None), many @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [1024, 1000, 7])
def test_greedy_is_the_first_maximum_of_the_product(lib, vocab):
    torch.manual_seed(2)
    w = torch.randn(1024, 64) * 0.1
    bits = w[40].view(torch.int32)
    # near-ties the bf16 part cannot see: rows 40 and 41 share their top 16 bits, 41 is larger
    # in every low half; rows 5 and 300 tie row 40 exactly (the lower index must win)
    w[40] = (bits & -65536).view(torch.float32)
    w[41] = (bits | 0x7FFF).view(torch.float32)
    w[5], w[300] = w[40], w[40]
    head = NativeSplitHeadWeight(w)
    approx = torch.ops.torch_runner_native.dense_packed_linear  # the hi plane's product alone
    differs = 0
    for trial in range(40):
        x = torch.randn(3, 64)
        if trial % 2:
            x[1] = w[41 if trial % 4 == 1 else 40] * 50  # rows 5 / 40 / 41 / 300 at the top
        picked = head.greedy(x, vocab)
        assert picked is not None
        logits = head.linear(x, None)
        assert torch.equal(picked[0], first_max(logits, vocab))
        assert picked[1].all()
        differs += int((first_max(approx(x, head.hi, None, None), vocab) != picked[0]).sum())
    assert differs or vocab < 42  # the cases where the hi plane alone picks wrong were met


def test_greedy_declines_what_it_cannot_decide(lib):
    torch.manual_seed(3)
    w = torch.randn(64, 32)
    head = NativeSplitHeadWeight(w)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 32)
        x[1, 3] = bad
        assert head.greedy(x, 64) is None  # the runner then sees the non-finite logits
    assert head.greedy(torch.full((1, 32), 1e37), 64) is None  # logits may overflow
    assert head.greedy(torch.randn(1, 32, dtype=torch.float64), 64) is None
    w[7, 3] = float("inf")
    assert NativeSplitHeadWeight(w).greedy(torch.randn(1, 32), 64) is None


def test_bad_shapes_are_clear_errors(lib):
    with pytest.raises(ValueError, match="N % 4 == 0 and K % 16 == 0"):
        NativeSplitHeadWeight(torch.randn(6, 32))
    with pytest.raises(ValueError, match="fp32"):
        NativeSplitHeadWeight(torch.randn(8, 32, dtype=torch.bfloat16))
    head = NativeSplitHeadWeight(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match="takes K=32"):
        lib.split_linear(torch.randn(1, 16), head.hi, head.lo, None, None)
    with pytest.raises(RuntimeError, match="vocab must be in"):
        lib.split_greedy(torch.randn(1, 32), head.hi, head.lo, head.err, 9, head.wmax)
    with pytest.raises(RuntimeError, match="lo must be contiguous int16"):
        lib.split_linear(torch.randn(1, 32), head.hi, head.hi, None, None)


def test_engine_greedy_tokens_equal_the_full_logits_path(llama, monkeypatch, lib):
    """An fp32 engine picks greedy tokens through the screened head, and they are the tokens of
    the logits path (the head's greedy switched off); logprobs requests take the logits path."""
    from torch_runner import Engine, SamplingParams

    engine = Engine(llama[0], device="cpu", dtype="float32", max_total_tokens=256, block_size=4)
    head = engine.runner.model.lm_head.weight
    assert isinstance(head, NativeSplitHeadWeight)
    calls = []
    real_greedy = head.greedy
    monkeypatch.setattr(head, "greedy", lambda *a: calls.append(1) or real_greedy(*a))
    prompts = [[5, 6, 7], [100] * 11, list(range(30, 60))]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16)
    screened = [o.token_ids for o in engine.generate(prompts, params)]
    assert calls, "the greedy steps did not go through the screened head"
    with_logprobs = engine.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True,
                                                            max_tokens=16, logprobs=True))  # fmt: skip
    monkeypatch.setattr(head, "greedy", lambda *a: None)
    full = [o.token_ids for o in engine.generate(prompts, params)]
    assert screened == full == [o.token_ids for o in with_logprobs]
