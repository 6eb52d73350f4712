"""Reading Hugging Face safetensors checkpoints, single-file or sharded, without unpickling.

Tensors come back memory-mapped (safetensors' mmap backend), so opening a checkpoint costs
address space, not RAM; the loader converts each tensor to its target dtype/device one at a
time. Every failure names the file at fault: a pickled `*.bin` folder is refused (we never
unpickle), a missing shard, a corrupt header and a truncated file each get their own message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from models.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model folder: the shards named by the index, else `*.safetensors`."""
    index_path = path / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index_path}: not a valid safetensors index ({exc})") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{index_path} names shard(s) that are missing: {', '.join(missing)}"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for pattern in PICKLE_PATTERNS for p in path.glob(pattern))
    if pickled:
        raise ModelLoadError(
            f"{path} holds only pickled weights ({', '.join(pickled)}); torch_runner never unpickles "
            "checkpoints: convert them to safetensors (save_pretrained(..., safe_serialization=True))"
        )
    raise ModelLoadError(f"{path} has no *.safetensors weights (and no {INDEX_FILE})")


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({exc})") from exc


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint by name (memory-mapped, checkpoint dtype, on CPU)."""
    tensors: dict[str, torch.Tensor] = {}
    for file, name, tensor in iter_tensors(files):
        if name in tensors:
            raise ModelLoadError(f"tensor {name!r} appears twice (again in {file.name})")
        tensors[name] = tensor
    return tensors


def iter_tensors(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yield (file, name, tensor) for every tensor; a damaged file raises ModelLoadError."""
    for file in files:
        handle = _open(file)
        with handle as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a Mapping
                try:
                    tensor = reader.get_tensor(name)
                except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                    raise ModelLoadError(f"{file}: cannot read tensor {name!r} ({exc})") from exc
                yield file, name, tensor


def checkpoint_dtype(files: list[Path]) -> torch.dtype | None:
    """The dtype of the first floating-point tensor (what `dtype="auto"` falls back to)."""
    for _, _, tensor in iter_tensors(files[:1]):
        if tensor.is_floating_point():
            return tensor.dtype
    return None
