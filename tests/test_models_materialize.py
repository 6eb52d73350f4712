"""Loading without a second copy (models/materialize.py, safetensors_io.FileTensor): every tensor
is read again with pread into its own memory, slices read only their bytes, q/k/v and gate/up
land straight in one fused buffer, and no mapping of the checkpoint file stays behind. The
oracle is safetensors' own reader (`load_file`) and torch's `narrow`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_checkpoint

from models import load_model, safetensors_io
from models.safetensors_io import FileTensor

TENSORS = {
    "bf16": torch.randn(7, 13).bfloat16(),
    "fp32_3d": torch.randn(3, 5, 11),
    "uint8_4d": torch.randint(0, 255, (4, 6, 3, 16), dtype=torch.uint8),
    "scalar": torch.tensor(3.0),
    "fp8": torch.randn(8, 16).to(torch.float8_e4m3fn),
}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("scratch", [64, 1 << 24])  # 64 bytes: strided slices in many reads
def test_file_tensor_reads_whole_tensors_and_slices_like_narrow(tmp_path, monkeypatch, scratch):
    monkeypatch.setattr(safetensors_io, "SCRATCH_BYTES", scratch)
    file = tmp_path / "t.safetensors"
    save_file(TENSORS, str(file))
    for name, t in TENSORS.items():
        whole = FileTensor(file, name).read()
        assert whole.dtype == t.dtype and whole.shape == t.shape
        assert torch.equal(_bytes(whole), _bytes(t)), name
        for dim in range(t.dim()):
            size = t.shape[dim]
            for start, length in ((0, size), (size // 3, size - size // 3), (1, size - 2)):
                for pad in (0, 2):
                    got = FileTensor(file, name, dim, start, length, pad).read()
                    assert got.shape[dim] == length + pad
                    part = t.narrow(dim, start, length)
                    assert torch.equal(_bytes(got.narrow(dim, 0, length)), _bytes(part)), name
                    assert not _bytes(got.narrow(dim, length, pad)).any()
                    into = torch.ones(got.shape, dtype=torch.float32).to(got.dtype)
                    FileTensor(file, name, dim, start, length, pad).read(out=into)
                    assert torch.equal(_bytes(into), _bytes(got))


@pytest.mark.parametrize(("model_type", "dtype"), [("llama", "float32"), ("qwen2", "bfloat16")])
def test_load_fills_fused_buffers_and_keeps_no_mapping_of_the_file(tmp_path, model_type, dtype):
    """qwen2 has q/k/v biases (fused too); bfloat16 casts each fp32 tensor as it is copied."""
    path = save_tiny_checkpoint(model_type, tmp_path, tie_word_embeddings=False)
    file = next(Path(path).glob("*.safetensors"))
    loaded = load_model(path, device="cpu", dtype=dtype)
    if sys.platform.startswith("linux"):  # the checks' memory map is gone with the load
        assert str(file) not in Path("/proc/self/maps").read_text()
    want = load_file(str(file))  # (itself a mapping of the file)
    state = loaded.model.state_dict()
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor.to(getattr(torch, dtype))), name
    attn, mlp = loaded.model.model.layers[0].self_attn, loaded.model.model.layers[0].mlp
    for fused, parts in ((attn.qkv_weight, (attn.q_proj, attn.k_proj, attn.v_proj)),
                         (mlp.gate_up_weight, (mlp.gate_proj, mlp.up_proj))):  # fmt: skip
        storage = fused.untyped_storage().data_ptr()
        assert all(p.weight.untyped_storage().data_ptr() == storage for p in parts)
        assert torch.equal(fused, torch.cat([p.weight for p in parts]))
    if model_type == "qwen2":
        assert (
            attn.qkv_bias.untyped_storage().data_ptr()
            == attn.q_proj.bias.untyped_storage().data_ptr()
        )


def test_fp8_nan_code_is_found_on_the_loaded_copy(tmp_path):
    """fp8 NaN codes are counted on each weight's own copy (not on the mapped file): one NaN
    byte (0x7F) is one load error naming the tensor."""
    from fp8_checkpoints import rewrite, write_fp8_checkpoint

    from models import ModelLoadError

    fp8_dir, _ = write_fp8_checkpoint(tmp_path, "channel")
    name = "model.layers.1.mlp.down_proj.weight"
    weight = load_file(str(fp8_dir / "model.safetensors"))[name].clone()
    weight.view(torch.uint8)[3, 5] = 0x7F
    rewrite(fp8_dir, {name: weight})
    with pytest.raises(ModelLoadError, match=rf"{name}' has 1 fp8 NaN value"):
        load_model(fp8_dir, device="cpu", dtype="float32")


def test_a_lazy_tensor_without_its_read_is_a_load_error_naming_it():
    """A meta tensor sanitize left to be read later must still be its recorded read; else a clear
    error instead of torch's 'cannot copy out of meta tensor'."""
    from torch import nn

    from models.errors import ModelLoadError
    from models.materialize import materialize

    with torch.device("meta"):
        model = nn.Linear(4, 3, bias=False)
    weights = {"weight": torch.empty(3, 4, device="meta")}
    with pytest.raises(ModelLoadError, match="'weight': its bytes were never read"):
        materialize(model, weights, {}, torch.device("cpu"), torch.float32)
