"""The loader's contract: a broken model folder fails before serving, with a message naming the
path, field or tensor at fault; good folders load single-file, sharded, in each dtype, or as
dummy weights. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB_SIZE, build_tiny_model, save_tiny_checkpoint

import models
from models import ModelLoadError

MODEL_TYPE = "qwen3"  # small, has every kind of tensor the checks look at (biases aside)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return save_tiny_checkpoint(MODEL_TYPE, tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A private copy of the tiny checkpoint that a test may damage."""
    return shutil.copytree(pristine, tmp_path / "model")


def load(path, **kwargs):
    return models.load_model(path, device="cpu", **kwargs)


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def logits(loaded, ids):
    with torch.no_grad():
        positions = torch.arange(ids.shape[1])[None]
        return loaded.model.compute_logits(loaded.model(ids, positions, None))


IDS = torch.randint(3, VOCAB_SIZE, (1, 24), generator=torch.Generator().manual_seed(0))


# ---- malformed folders -------------------------------------------------------------------


def test_missing_path_names_it(tmp_path):
    with pytest.raises(ModelLoadError, match="does-not-exist.*does not exist"):
        load(tmp_path / "does-not-exist")


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load(tmp_path)


def test_config_that_is_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        load(ckpt)


def test_unsupported_model_type_lists_supported(ckpt):
    edit_config(ckpt, model_type="bert")
    with pytest.raises(ModelLoadError, match="model_type='bert' is not supported") as err:
        load(ckpt)
    for supported in ("gpt_oss", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe"):
        assert supported in str(err.value)


@pytest.mark.parametrize("field", ["model_type", "hidden_size", "num_hidden_layers", "vocab_size"])
def test_missing_config_field_is_named(ckpt, field):
    edit_config(ckpt, **{field: None})
    with pytest.raises(ModelLoadError, match=f"missing required field\\(s\\): {field}"):
        load(ckpt)


def test_missing_moe_field_is_named(tmp_path):
    path = save_tiny_checkpoint("qwen3_moe", tmp_path)
    edit_config(path, num_experts_per_tok=None)
    with pytest.raises(ModelLoadError, match="missing required field\\(s\\): num_experts_per_tok"):
        load(path)


def test_missing_tensor_is_named(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(
        ModelLoadError, match="missing 1 tensor\\(s\\): model.layers.1.self_attn.k_norm.weight"
    ):
        load(ckpt)


def test_extra_tensor_is_named(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(
        ModelLoadError, match="unexpected tensor\\(s\\): model.layers.0.mlp.extra.weight"
    ):
        load(ckpt)


def test_shape_mismatch_names_tensor_expected_and_found(ckpt):
    edit_tensors(
        ckpt, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(100, 64)})
    )
    with pytest.raises(ModelLoadError) as err:
        load(ckpt)
    message = str(err.value)
    assert "model.layers.2.mlp.up_proj.weight" in message
    assert "(100, 64)" in message and "expected (128, 64)" in message


def test_corrupt_header_names_the_file(ckpt):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:8] + b"{garbage" + data[16:])
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt or truncated"):
        load(ckpt)


def test_truncated_file_names_the_file(ckpt):
    file = ckpt / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt or truncated"):
        load(ckpt)


def test_pickled_checkpoint_is_refused_without_unpickling(ckpt, monkeypatch):
    import pickle

    def forbidden(*args, **kwargs):
        raise AssertionError("the loader must never unpickle")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin.*never unpickles"):
        load(ckpt)


def test_folder_without_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        load(ckpt)


@pytest.mark.parametrize(("field", "value"), [("dtype", "float64"), ("load_format", "pt")])
def test_bad_argument_lists_allowed_values(ckpt, field, value):
    with pytest.raises(
        ModelLoadError, match=f"{field}='{value}' is not supported; allowed values: "
    ):
        load(ckpt, **{field: value})


# ---- good folders --------------------------------------------------------------------------


def test_sharded_checkpoint_loads_like_single_file(pristine, tmp_path):
    build_tiny_model(MODEL_TYPE).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded, single = load(tmp_path, dtype="float32"), load(pristine, dtype="float32")
    assert torch.equal(logits(sharded, IDS), logits(single, IDS))


def test_missing_shard_is_named(tmp_path):
    build_tiny_model(MODEL_TYPE).save_pretrained(tmp_path, max_shard_size="40KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"shard\\(s\\) that are missing: {victim.name}"):
        load(tmp_path)


@pytest.mark.parametrize(
    ("dtype", "expected", "tol"),
    [
        ("float32", torch.float32, 0),
        ("bfloat16", torch.bfloat16, 0.1),
        ("float16", torch.float16, 0.02),
    ],
)
def test_dtype_choice_casts_every_weight(pristine, dtype, expected, tol):
    reference = logits(load(pristine, dtype="float32"), IDS)
    loaded = load(pristine, dtype=dtype)
    assert {p.dtype for p in loaded.model.parameters()} == {expected}
    assert loaded.model.model.rotary.inv_freq.dtype == torch.float32  # rope tables stay fp32
    assert (logits(loaded, IDS).float() - reference).abs().max().item() <= tol


def test_dtype_auto_follows_config(ckpt):
    assert next(load(ckpt).model.parameters()).dtype == torch.float32
    edit_config(ckpt, dtype="bfloat16")
    assert next(load(ckpt).model.parameters()).dtype == torch.bfloat16


def test_loaded_model_is_materialised_and_frozen(pristine):
    loaded = load(pristine)
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    assert all(t.device.type == "cpu" for t in tensors)  # nothing left on `meta`
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_dummy_weights_need_only_the_config(ckpt):
    (ckpt / "model.safetensors").unlink()
    first, second = load(ckpt, load_format="dummy"), load(ckpt, load_format="dummy")
    named = dict(first.model.named_parameters())
    assert torch.equal(named["model.norm.weight"], torch.ones(64))
    q = named["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (64, 64) and 0.01 < q.std().item() < 0.03
    assert torch.equal(logits(first, IDS), logits(second, IDS))  # seeded
    assert torch.isfinite(logits(first, IDS)).all()


def test_tied_checkpoint_that_stores_lm_head_still_loads(tmp_path):
    path = save_tiny_checkpoint("llama", tmp_path)  # tied: no lm_head tensor saved
    embed = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"]
    edit_tensors(path, lambda t: t.update({"lm_head.weight": embed.clone()}))
    loaded = load(path, dtype="float32")
    hidden = torch.randn(3, 64)
    assert torch.allclose(loaded.model.compute_logits(hidden), hidden @ embed.T, atol=1e-5)


def test_eos_ids_come_from_generation_config(ckpt):
    assert load(ckpt).eos_token_ids == [2]  # tiny configs declare eos 2
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = load(ckpt)
    assert loaded.eos_token_ids == [2, 7]
    assert loaded.generation_config == {"eos_token_id": [2, 7]}


def test_legacy_rope_keys_load_like_rope_parameters(tmp_path):
    """Older config.json files keep `rope_theta` + `rope_scaling` at top level (Llama 3.1 style)."""
    path = save_tiny_checkpoint("llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope  # {"rope_type": "llama3", "factor": 8.0, ...}
    (path / "config.json").write_text(json.dumps(config))
    loaded = load(path, dtype="float32")
    assert loaded.args.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        want = build_tiny_model("llama")(IDS).logits
    assert (logits(loaded, IDS) - want).abs().max().item() < 1e-4


def test_dummy_gemma_norms_scale_by_one(tmp_path):
    """Gemma norms multiply by (1 + weight): dummy weights must be 0 there, not 1."""
    path = save_tiny_checkpoint("gemma3_text", tmp_path)
    (path / "model.safetensors").unlink()
    named = dict(load(path, load_format="dummy").model.named_parameters())
    assert torch.equal(named["model.norm.weight"], torch.zeros(64))
    assert torch.equal(named["model.layers.0.self_attn.q_norm.weight"], torch.zeros(16))
