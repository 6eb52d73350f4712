"""Each rank reads only its shard: a tensor the plan slices along one dimension is taken with
`safe_open(...).get_slice(name)[...]`, a view of the memory-mapped file that nothing touches
while the loader checks names and shapes. Its `FileTensor` names the slice, so the loader then
reads just those bytes with pread into the rank's memory (models/materialize.py): a rank's
resident memory is its shard, not the checkpoint, and no file page stays mapped. Per-expert
Hub tensors (plan.raw_slices) are read as slices alike, and the family's sanitize stacks them
without reading (safetensors_io.stack_reads). Tensors the plan keeps whole are read whole."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError

from models import safetensors_io
from models.errors import ModelLoadError
from models.safetensors_io import FileTensor, note_origin, pad_along


def read_shard(plan, files: list[Path], origins=None) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor: this rank's part where the plan has a one-dimension slice
    (recorded in `plan.presliced`, so `shard_tensor` does not cut it again), else the whole;
    where each came from goes into `origins` (safetensors_io.note_origin)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safetensors_io._open(file) as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name in tensors:
                    raise ModelLoadError(f"tensor {name!r} appears twice (again in {file.name})")
                cut = plan.slices.get(name) or plan.raw_slices.get(name, (None,))[0]
                spec = getattr(cut, "spec", None)  # raw: a per-expert tensor sanitize stacks
                try:
                    if spec is None or name in plan.rank0_only:
                        tensors[name] = reader.get_tensor(name)
                        note_origin(origins, tensors[name], FileTensor(file, name))
                        continue
                    where = FileTensor(file, name, *spec)
                    tensors[name] = _mapped_slice(reader, where)
                except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                    raise ModelLoadError(f"{file}: cannot read tensor {name!r} ({exc})") from exc
                note_origin(origins, tensors[name], where)
                plan.presliced.add(name)
    return tensors


def _mapped_slice(reader, where: FileTensor) -> torch.Tensor:
    part = reader.get_slice(where.name)
    index = tuple(
        slice(where.start, where.start + where.length) if d == where.dim else slice(None)
        for d in range(len(part.get_shape()))
    )
    return pad_along(part[index], where.dim, where.pad)
