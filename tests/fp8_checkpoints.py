"""Tiny fp8 checkpoints written in the test: a seeded tiny llama whose decoder linears are stored
as float8_e4m3fn plus scales (per tensor, per channel or per block), and, as the oracle, the same
folder with those weights dequantised to fp32 (what every fp8 path must compute from)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from engine_helpers import byte_tokenizer
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model

from ops.quant.fp8 import FP8_DTYPE, FP8_MAX

BLOCK = (32, 32)  # tiny shapes: several blocks per weight, the q/k/v rows multiples of 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIGS = {
    "tensor": {  # llm-compressor FP8 (static per-tensor): weight_scale [1], input_scale
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}}},
        "ignore": ["lm_head"],
    },
    "channel": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},  # [N, 1]
    "block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(BLOCK)},  # DeepSeek / Qwen3-FP8: weight_scale_inv
}  # fmt: skip


def quantize(w: torch.Tensor, layout: str):
    """(fp8 weight, scale as the layout stores it, its dequantisation in fp32)."""
    w = w.detach().float()
    n, k = w.shape
    if layout == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(1)
        full = scale.expand(n, k)
    elif layout == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX  # [N, 1]
        full = scale.expand(n, k)
    else:
        bn, bk = BLOCK
        blocks = w.reshape(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3))
        scale = blocks / FP8_MAX  # [N / bn, K / bk]
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale, q.float() * full


def write_fp8_checkpoint(directory: Path, layout: str, **overrides) -> tuple[Path, Path]:
    """(fp8 folder, dequantised fp32 folder) of one seeded tiny llama."""
    dense_dir, fp8_dir = directory / "dequantised", directory / f"fp8_{layout}"
    model = build_tiny_model("llama", tie_word_embeddings=False, **overrides)
    model.save_pretrained(dense_dir)
    byte_tokenizer().save_pretrained(dense_dir)
    shutil.copytree(dense_dir, fp8_dir)
    tensors = load_file(dense_dir / "model.safetensors")
    dense, quantized = dict(tensors), dict(tensors)
    suffix = ".weight_scale_inv" if layout == "block" else ".weight_scale"
    for name, w in tensors.items():
        if name.rsplit(".", 2)[-2] in LINEARS:
            q, scale, deq = quantize(w, layout)
            quantized[name] = q
            quantized[name.removesuffix(".weight") + suffix] = scale
            if layout == "tensor":  # static activation scales, which the loader ignores
                quantized[name.removesuffix(".weight") + ".input_scale"] = torch.ones(1)
            dense[name] = deq
    save_file(dense, dense_dir / "model.safetensors")
    save_file(quantized, fp8_dir / "model.safetensors")
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = CONFIGS[layout]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, dense_dir


def rewrite(folder: Path, tensors=None, config=None) -> None:
    """Edit a checkpoint folder in place: tensors (name -> tensor or None to drop), config keys."""
    if tensors:
        current = load_file(folder / "model.safetensors")
        for name, value in tensors.items():
            if value is None:
                current.pop(name)
            else:
                current[name] = value
        save_file(current, folder / "model.safetensors")
    if config:
        raw = json.loads((folder / "config.json").read_text())
        raw.update(config)
        (folder / "config.json").write_text(json.dumps(raw))
