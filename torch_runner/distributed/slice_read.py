"""Each rank reads only its shard: a tensor the plan slices along one dimension is read with
`safe_open(...).get_slice(name)[...]` (only that part is copied out of the file), from a
reader opened for that tensor alone, so the file pages it touched are unmapped again at once
and a rank's resident memory is its shard, not the checkpoint. Tensors the plan keeps whole, or
that the family's sanitize rewrites (per-expert stacks, MXFP4 dequantization), are memory-mapped
whole as at one rank."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError

from models import safetensors_io
from models.errors import ModelLoadError


def read_shard(plan, files: list[Path]) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor: this rank's part where the plan has a one-dimension slice
    (recorded in `plan.presliced`, so `shard_tensor` does not cut it again), else the whole."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        whole = safetensors_io._open(file)
        with whole as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name in tensors:
                    raise ModelLoadError(f"tensor {name!r} appears twice (again in {file.name})")
                spec = getattr(plan.slices.get(name), "spec", None)
                try:
                    if spec is None or name in plan.rank0_only:
                        tensors[name] = reader.get_tensor(name)
                        continue
                    tensors[name] = _read_slice(file, name, *spec)
                except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                    raise ModelLoadError(f"{file}: cannot read tensor {name!r} ({exc})") from exc
                plan.presliced.add(name)
    return tensors


def _read_slice(file: Path, name: str, dim: int, start: int, length: int, pad: int):
    with safetensors_io._open(file) as reader:  # its own mapping, released on exit
        part = reader.get_slice(name)
        index = tuple(
            slice(start, start + length) if d == dim else slice(None)
            for d in range(len(part.get_shape()))
        )
        tensor = part[index]
    if not pad:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = pad
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)
