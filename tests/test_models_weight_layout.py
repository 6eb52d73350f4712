"""Input-major weight storage (`store_input_major`, the runner's `weight_packing=auto` on CPU).

Contract: only the memory layout changes. Every linear weight (and a tied embedding, which is
the lm_head) is stored [in, out] and exposed as an [out, in] view, so the state dict keeps HF
names, shapes and values, the fused q/k/v and gate/up matrices still share storage with the
HF-named parameters, no memory is added, and the forward gives the same logits as the model
left as loaded (the oracle: the same checkpoint loaded twice, one copy re-stored).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import byte_tokenizer
from tiny_models import FAMILIES, VOCAB_SIZE, save_tiny_checkpoint
from torch import nn

import models
from models.layers import Attention, GatedMLP, store_input_major
from torch_runner import Engine, SamplingParams


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = save_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    byte_tokenizer().save_pretrained(path)
    return path


def storage_bytes(model: nn.Module) -> int:
    seen = {}
    for t in list(model.parameters()) + [b for b in model.buffers() if b is not None]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def test_layout_changes_memory_order_only(checkpoint):
    torch.set_num_threads(1)
    plain = models.load_model(checkpoint, device="cpu", dtype="float32").model
    moved = models.load_model(checkpoint, device="cpu", dtype="float32").model
    before = {k: v.clone() for k, v in moved.state_dict().items()}
    store_input_major(moved)
    after = moved.state_dict()
    assert list(after) == list(before)
    for name, value in before.items():
        assert after[name].shape == value.shape, name
        assert torch.equal(after[name], value), name
    linears = [m for m in moved.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.stride(0) == 1 for m in linears)  # [in, out] in memory
    for module in moved.modules():
        if isinstance(module, Attention):
            assert module.q_proj.weight.data_ptr() == module.qkv_weight.data_ptr()
        if isinstance(module, GatedMLP):
            assert module.gate_proj.weight.data_ptr() == module.gate_up_weight.data_ptr()
    assert storage_bytes(moved) == storage_bytes(plain)  # re-stored, not duplicated

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB_SIZE, (2, 9), generator=gen)
    positions = torch.arange(9).expand(2, -1)
    with torch.inference_mode():
        want = plain.compute_logits(plain(ids, positions))
        got = moved.compute_logits(moved(ids, positions))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_engine_weight_packing_auto_equals_off(checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 17, 3], [11, 4, 8, 30, 2, 7, 19]]
    outs = {}
    for packing in ("auto", "off"):
        engine = Engine(checkpoint, device="cpu", dtype="float32", weight_packing=packing,
                        max_total_tokens=512)  # fmt: skip
        is_moved = all(
            m.weight.stride(0) == 1 for m in engine.runner.model.modules()
            if isinstance(m, nn.Linear)
        )  # fmt: skip
        assert is_moved == (packing == "auto")
        outs[packing] = [r.token_ids for r in engine.generate(prompts, params)]
    assert outs["auto"] == outs["off"]


def test_weight_packing_rejects_unknown_value():
    with pytest.raises(ValueError, match="weight_packing='onednn'.*auto, off"):
        Engine(None, device="cpu", weight_packing="onednn")
