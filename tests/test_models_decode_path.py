"""The decode fast path: fused q/k/v and gate/up matmuls, rope tables built once per forward.

Why these contracts: the loader fuses projections after loading, so every parity test runs the
fused path; the oracle here is the same model left unfused (HF's three/two separate linears,
what a model built without the loader runs). Pinned:
- the state dict keeps HF names and shapes, and the fused tensors share storage with them, so
  load_state_dict after loading still reaches the fused matmul;
- fused and unfused forwards agree (fp32, every family);
- cos/sin are computed once per rope kind per forward, not once per layer.
"""

from __future__ import annotations

import collections

import pytest
import torch
from tiny_models import FAMILIES, VOCAB_SIZE, save_tiny_checkpoint
from torch.profiler import ProfilerActivity, profile

import models
from models.layers import Attention, GatedMLP
from models.registry import get_family


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request, tmp_path_factory):
    torch.set_num_threads(1)
    path = save_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return models.load_model(path, device="cpu", dtype="float32")


def unfused_copy(loaded) -> torch.nn.Module:
    """The same weights in a model that was never fused (the separate HF linears)."""
    family = get_family(loaded.hf_config.model_type)
    model = family.Model(loaded.args).eval()
    model.load_state_dict({k: v.clone() for k, v in loaded.model.state_dict().items()})
    return model


def ids_and_positions(batch=2, length=12):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB_SIZE, (batch, length), generator=gen)  # [B, N]
    return ids, torch.arange(length).expand(batch, -1)


def test_state_dict_keeps_hf_names_and_shares_fused_storage(loaded):
    model = loaded.model
    fused = [m for m in model.modules() if isinstance(m, (Attention, GatedMLP))]
    assert fused, "no fusable module found"
    names = set(model.state_dict())
    assert not any("qkv" in n or "gate_up_weight" in n for n in names)
    for module in fused:
        if isinstance(module, Attention):
            parts, weight = (module.q_proj, module.k_proj, module.v_proj), module.qkv_weight
        else:
            parts, weight = (module.gate_proj, module.up_proj), module.gate_up_weight
        assert weight is not None
        assert torch.equal(weight, torch.cat([p.weight for p in parts]))
        assert parts[0].weight.data_ptr() == weight.data_ptr()  # a view, not a copy


@torch.no_grad()
def test_fused_forward_equals_unfused(loaded):
    ids, positions = ids_and_positions()
    reference = unfused_copy(loaded)
    assert all(
        getattr(m, "qkv_weight", 0) is None for m in reference.modules() if isinstance(m, Attention)
    )
    got = loaded.model.compute_logits(loaded.model(ids, positions, None))
    want = reference.compute_logits(reference(ids, positions, None))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_load_state_dict_after_fusing_reaches_the_fused_matmul(loaded, tmp_path):
    ids, positions = ids_and_positions()
    reference = unfused_copy(loaded)
    gen = torch.Generator().manual_seed(5)
    perturbed = {
        k: v + 0.01 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
        for k, v in reference.state_dict().items()
    }
    reference.load_state_dict(perturbed)
    model = models.load_model(loaded.path, device="cpu", dtype="float32").model
    model.load_state_dict(perturbed)
    got = model.compute_logits(model(ids, positions, None))
    want = reference.compute_logits(reference(ids, positions, None))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rope_cos_sin_once_per_rope_kind_per_forward(loaded):
    ids, positions = ids_and_positions(batch=1, length=4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loaded.model(ids, positions, None)
    counts = collections.Counter(e.name for e in prof.events())
    rope_kinds = 2 if loaded.hf_config.model_type == "gemma3_text" else 1
    assert loaded.args.num_hidden_layers > rope_kinds
    assert counts["aten::cos"] == rope_kinds
    assert counts["aten::sin"] == rope_kinds


@torch.no_grad()
def test_routed_apply_rope_keeps_its_per_layer_call(loaded, monkeypatch):
    """With apply_rope routed to MLX the tables are skipped and the routed op runs per layer."""
    pytest.importorskip("mlx.core")
    from bridge import runtime
    from ops import registry

    ids, positions = ids_and_positions()
    want = loaded.model(ids, positions, None)
    monkeypatch.setenv(runtime.ENV_USE_MLX, "1")
    runtime.reset_cache()
    try:
        assert registry.configure("apply_rope")["apply_rope"] == "mlx"
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = loaded.model(ids, positions, None)
    finally:
        monkeypatch.delenv(runtime.ENV_USE_MLX)
        runtime.reset_cache()
        registry.configure()
    assert not any(e.name == "aten::cos" for e in prof.events())  # no torch tables built
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
