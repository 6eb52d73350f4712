"""patch / unpatch on real diffusers transformers (tiny random configs, built offline).

Oracle: the same transformer before patching. Patched forward must match it (fp32 1e-5, bf16
2e-2), every stand-in must actually run, and unpatch must put back the very same module objects.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bridge.runtime import reset_cache
from ops.diffusion import patch, unpatch
from ops.diffusion.modules import OpsModule
from ops.diffusion.tiny import (
    tiny_flux_pipeline,
    tiny_pixart_transformer,
    tiny_sana_transformer,
    tiny_transformer_inputs,
)

pytest.importorskip("diffusers")

BUILDERS = {
    "flux": lambda: tiny_flux_pipeline().transformer,
    "sana": tiny_sana_transformer,
    "pixart": tiny_pixart_transformer,
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _forward(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_patched_transformer_matches_unpatched(family, dtype):
    model = BUILDERS[family]().to(dtype)
    inputs = tiny_transformer_inputs(model)
    expected = _forward(model, inputs)
    assert expected.abs().max() > 0.1  # a real signal, not an all-zero output

    report = patch(model, backend="torch")
    calls = []
    for module in model.modules():
        if isinstance(module, OpsModule):
            module.register_forward_hook(lambda m, args, out: calls.append(type(m).__name__))
    out = _forward(model, inputs)

    assert report.backend == "torch" and report.replaced
    assert len(calls) >= len(report.replaced)  # every stand-in ran (qk norms run once per block)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=0)


def test_flux_report_names_each_swap_and_each_reason():
    model = tiny_flux_pipeline(num_layers=1, num_single_layers=1).transformer
    report = patch(model)
    replaced = {entry.name: entry.detail for entry in report.replaced}
    assert replaced == {
        "transformer_blocks.0.norm1": "OpsAdaLayerNormZero",
        "transformer_blocks.0.norm1_context": "OpsAdaLayerNormZero",
        "transformer_blocks.0.attn.norm_q": "OpsNorm",
        "transformer_blocks.0.attn.norm_k": "OpsNorm",
        "transformer_blocks.0.attn.norm_added_q": "OpsNorm",
        "transformer_blocks.0.attn.norm_added_k": "OpsNorm",
        "transformer_blocks.0.norm2": "OpsNorm",
        "transformer_blocks.0.norm2_context": "OpsNorm",
        "single_transformer_blocks.0.norm": "OpsAdaLayerNormZeroSingle",
        "single_transformer_blocks.0.attn.norm_q": "OpsNorm",
        "single_transformer_blocks.0.attn.norm_k": "OpsNorm",
        "norm_out": "OpsAdaLayerNormContinuous",
    }
    [block] = report.left_alone
    assert block.name == "transformer_blocks.0" and "inline" in block.detail
    assert "norm_out" in str(report) and "inline" in str(report)


def test_sana_report_swaps_modulated_norm_and_explains_adaln_single():
    model = tiny_sana_transformer(num_layers=1)
    report = patch(model)
    replaced = {entry.name: entry.detail for entry in report.replaced}
    assert replaced["norm_out"] == "OpsSanaModulatedNorm"
    assert replaced["caption_norm"] == "OpsNorm"  # diffusers RMSNorm
    left = {entry.name: entry.detail for entry in report.left_alone}
    assert "no normalisation" in left["time_embed"]


def test_unpatch_restores_the_same_module_objects_and_output():
    model = tiny_flux_pipeline(num_layers=1, num_single_layers=1).transformer
    inputs = tiny_transformer_inputs(model)
    before = dict(model.named_modules())
    expected = _forward(model, inputs)

    report = patch(model)
    restored = unpatch(model)

    assert sorted(restored) == sorted(entry.name for entry in report.replaced)
    after = dict(model.named_modules())
    assert after.keys() == before.keys()
    assert all(after[name] is module for name, module in before.items())
    assert torch.equal(_forward(model, inputs), expected)
    assert unpatch(model) == []


def test_state_dict_and_parameters_are_shared_not_copied():
    model = tiny_sana_transformer(num_layers=1)
    before = model.state_dict()
    patch(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].data_ptr() == before[k].data_ptr() for k in before)


def test_patching_twice_changes_nothing_more():
    model = tiny_flux_pipeline(num_layers=1, num_single_layers=1).transformer
    first = patch(model)
    second = patch(model)
    assert second.replaced == []
    assert {e.name for e in second.left_alone if e.detail == "already patched"} == {
        e.name for e in first.replaced
    }
    unpatch(model)
    assert not any(isinstance(m, OpsModule) for m in model.modules())


def test_dtype_cast_after_patch_reaches_the_originals():
    model = tiny_sana_transformer(num_layers=1)
    reference = tiny_sana_transformer(num_layers=1).to(torch.bfloat16)
    patch(model)
    model.to(torch.bfloat16)
    inputs = tiny_transformer_inputs(model)
    torch.testing.assert_close(
        _forward(model, inputs), _forward(reference, inputs), atol=2e-2, rtol=0
    )
    unpatch(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.equal(_forward(model, inputs), _forward(reference, inputs))


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.flat = nn.LayerNorm(8)
        self.plane = nn.LayerNorm((4, 8))
        self.groups = nn.GroupNorm(2, 4)
        self.rms = nn.RMSNorm(8)  # eps=None: machine epsilon of the input dtype

    def forward(self, x):  # x [B, 4, 8]
        return self.flat(x) + self.plane(x) + self.groups(x) + self.rms(x)


def test_unmappable_norms_are_left_alone_with_a_reason():
    model = _Mixed()
    x = torch.randn(3, 4, 8)
    expected = _forward_plain(model, x)
    report = patch(model)
    assert {e.name for e in report.replaced} == {"flat", "rms"}
    left = {e.name: e.detail for e in report.left_alone}
    assert "2 trailing dims" in left["plane"]
    assert "channel groups" in left["groups"]
    torch.testing.assert_close(_forward_plain(model, x), expected, atol=1e-5, rtol=0)
    [root] = patch(nn.LayerNorm(8)).left_alone
    assert "patch its parent" in root.detail


def _forward_plain(model, x):
    with torch.no_grad():
        return model(x)


def test_bad_backend_and_bad_module_are_rejected_by_name(monkeypatch):
    with pytest.raises(
        ValueError, match=r"backend='cuda' is not supported; allowed values: None, 'torch', 'mlx'"
    ):
        patch(nn.LayerNorm(4), backend="cuda")
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        patch("transformer")
    monkeypatch.delenv("TORCH_RUNNER_USE_MLX", raising=False)
    reset_cache()
    with pytest.raises(ValueError, match="backend='mlx' needs TORCH_RUNNER_USE_MLX=1"):
        patch(nn.Sequential(nn.LayerNorm(4)), backend="mlx")
