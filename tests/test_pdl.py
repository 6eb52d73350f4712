"""Programmatic dependent launch (ops/pdl.py): the switch, and on CUDA (sm_90+) a decode-like
chain of the PDL-aware Triton kernels in a CUDA graph giving the same bits with PDL on and off,
replay after replay (a missing wait would read a buffer before its writer finished)."""

from __future__ import annotations

import pytest
import torch

from ops import pdl

HAS_CUDA = torch.cuda.is_available()


def test_pdl_mode_names_the_variable_and_the_allowed_values(monkeypatch):
    monkeypatch.setenv(pdl.ENV_PDL, " Off")
    assert pdl.pdl_mode() == "off"
    monkeypatch.setenv(pdl.ENV_PDL, "fast")
    with pytest.raises(
        ValueError, match="TORCH_RUNNER_PDL='fast': allowed values are auto, on, off"
    ):
        pdl.pdl_mode()


def test_pdl_is_never_asked_for_off_cuda(monkeypatch):
    monkeypatch.setenv(pdl.ENV_PDL, "on")
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch_args(torch.device("cuda", 0)) == {"PDL": False}  # no device query


def chain(x, res, w_qkv, s_qkv, w_up, s_up, w_down, s_down, norm_w):
    """norm -> fp8 GEMV (tensor cores) -> norm with residual -> GEMV -> SiLU-mul -> GEMV (FMA
    loop, split-K) -> greedy pick: each kernel reads what the one before wrote."""
    from ops.fused.triton_kernels import add_rms_norm, greedy_pick, silu_mul
    from ops.quant.gemv_triton import gemv

    h, r = add_rms_norm(x, res, norm_w, 1e-5)
    q = gemv(h, w_qkv, s_qkv, (32, 128, 1, 1), dot=True)
    h2, r2 = add_rms_norm(q[:, : x.shape[1]], r, norm_w, 1e-5)
    up = gemv(h2, w_up, s_up, (16, 256, 1, 1), dot=True, stages=4)
    act = silu_mul(up)
    down = gemv(act, w_down, s_down, (8, 256, 4, 4))
    tokens, _ = greedy_pick(down.float())
    return down, r2, tokens


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_pdl_chain_in_a_graph_equals_the_chain_without_pdl(monkeypatch):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90+")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hid, inter = 2048, 8192

    def fp8(n, k):
        w = torch.randn(n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        return w, torch.rand(n, device="cuda", generator=gen) * 0.01 + 0.001

    x = torch.randn(1, hid, device="cuda", generator=gen).bfloat16()
    res = torch.randn(1, hid, device="cuda", generator=gen).bfloat16()
    args = (x, res, *fp8(3 * hid, hid), *fp8(2 * inter, hid), *fp8(hid * 8, inter),
            torch.rand(hid, device="cuda", generator=gen).bfloat16())  # fmt: skip
    outputs = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(pdl.ENV_PDL, mode)
        eager = chain(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain(*args)
        for _ in range(20):  # every replay: the same bits as the eager chain
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(captured, eager, strict=True)), mode
        outputs[mode] = eager
    assert all(torch.equal(a, b) for a, b in zip(outputs["on"], outputs["off"], strict=True))
