"""Reading Hugging Face safetensors checkpoints, single-file or sharded, without unpickling.

Tensors come back memory-mapped (safetensors' mmap backend), so opening a checkpoint and checking
its names, shapes and dtypes costs address space, not RAM. Each comes with a `FileTensor` (where
its bytes are): the loader reads the bytes again with safetensors' pread backend into the
tensor's own memory when it fills the model (models/materialize.py), so the mapped file pages
are never touched and never count in the process's resident memory next to the copy. Every failure names the file at fault: a pickled `*.bin` folder is refused (we never
unpickle), a missing shard, a corrupt header and a truncated file each get their own message.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class FileTensor:
    """Where a checkpoint tensor's bytes are: the whole tensor `name` of `file`, or (dim set)
    `length` entries from `start` along `dim` followed by `pad` zero entries (a rank's slice)."""

    file: Path
    name: str
    dim: int | None = None
    start: int = 0
    length: int = 0
    pad: int = 0

    def read(self, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None):
        """The bytes read with pread(2) straight into a new tensor, or into `out` (a contiguous
        CPU tensor of the file's dtype and this read's shape: a slice of a fused buffer). No
        mapping stays behind; a slice reads its own bytes only, through a bounded scratch
        buffer when they are strided (`scratch`: a uint8 buffer of SCRATCH_BYTES to reuse, so a
        load of many slices does not allocate and free one per tensor)."""
        header, data_start = _header(self.file)
        info = header.get(self.name)
        if info is None or info.get("dtype") not in FILE_DTYPES:
            raise ModelLoadError(f"{self.file}: cannot read tensor {self.name!r} again")
        dtype, shape = FILE_DTYPES[info["dtype"]], list(info["shape"])
        offset = data_start + info["data_offsets"][0]
        if self.dim is not None:
            shape[self.dim] = self.length + self.pad
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif out.dtype != dtype or list(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"{self.name}: cannot read {info['dtype']} {shape} into {out.dtype} "
                             f"{tuple(out.shape)}")  # fmt: skip
        with open(self.file, "rb", buffering=0) as handle:
            if self.dim is None:
                _pread_into(handle, out, offset, self.file)
            else:
                if self.pad:
                    out.narrow(self.dim, self.length, self.pad).zero_()
                self._read_slice(handle, list(info["shape"]), offset, out, scratch)
        return out

    def _read_slice(self, handle, shape: list[int], offset: int, out: torch.Tensor, scratch):
        if not out.numel():
            return
        item = out.element_size()
        outer = math.prod(shape[: self.dim])  # the file's tensor as [outer, shape[dim], inner]
        inner = math.prod(shape[self.dim + 1 :])
        if outer == 1:  # one contiguous range (any pad rows follow it)
            target = out.reshape(-1)[: self.length * inner]
            _pread_into(handle, target, offset + self.start * inner * item, self.file)
            return
        rows = out.view(outer, self.length + self.pad, inner)[:, : self.length]
        full = shape[self.dim] * inner  # elements per outer index
        per_read = max(1, SCRATCH_BYTES // (full * item))
        nbytes = min(per_read, outer) * full * item
        if scratch is None or scratch.numel() < nbytes:
            scratch = torch.empty(nbytes, dtype=torch.uint8)
        scratch = scratch[:nbytes].view(out.dtype)
        for first in range(0, outer, per_read):  # whole rows, then this slice's columns
            count = min(per_read, outer - first)
            chunk = scratch[: count * full]
            _pread_into(handle, chunk, offset + first * full * item, self.file)
            part = chunk.view(count, shape[self.dim], inner)
            rows[first : first + count].copy_(part[:, self.start : self.start + self.length])


SCRATCH_BYTES = 1 << 24  # a strided slice is read whole rows at a time, at most this many bytes
FILE_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}  # fmt: skip


@functools.lru_cache(maxsize=16)
def _header_cached(file: str, size: int, mtime_ns: int) -> tuple[dict, int]:
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length)), 8 + length


def _header(file: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header and where its data starts (the format: an 8-byte
    little-endian length, the header, then the tensors' bytes at their `data_offsets`)."""
    try:
        stat = file.stat()
        return _header_cached(str(file), stat.st_size, stat.st_mtime_ns)
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({exc})") from exc


def _pread_into(handle, tensor: torch.Tensor, offset: int, file: Path) -> None:
    """Fill contiguous `tensor` with the file's bytes from `offset`."""
    if not tensor.numel():
        return
    buffer = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(buffer):  # pread may return less than asked (Linux: at most ~2 GiB a call)
        got = os.preadv(handle.fileno(), [buffer[done:]], offset + done)
        if got <= 0:
            raise ModelLoadError(f"{file}: truncated safetensors file (at byte {offset + done})")
        done += got


def pad_along(tensor: torch.Tensor, dim: int, pad: int) -> torch.Tensor:
    """`tensor` with `pad` zero entries appended along `dim` (a vocab padded to N ranks)."""
    if not pad:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = pad
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


Origins = dict  # checkpoint name -> (weakref to the tensor the loader holds, how to read it)


@dataclass(frozen=True)
class StackedRead:
    """A tensor stacked from checkpoint tensors (Qwen3-MoE's per-expert Hub tensors into one
    [E, ...] tensor): each part read with pread straight into its rows of the output, so neither
    the mapped pages nor a stack/cat copy ever exist beside it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[tuple[int, int, int, FileTensor], ...]  # (expert, first row, rows, read)

    def read(self, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None):
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype)
        for expert, row, rows, where in self.parts:
            where.read(out=out[expert].narrow(0, row, rows), scratch=scratch)
        return out


def file_reads(origins: Origins) -> dict[int, FileTensor]:
    """id(tensor) -> its FileTensor, for every tensor the loader still holds as read from the file
    (a family's sanitize finds its inputs' bytes by identity: names may have been renamed)."""
    return {id(t): where for ref, where in origins.values()
            if isinstance(where, FileTensor) and (t := ref()) is not None}  # fmt: skip


def lazy_tensor(origins: Origins, name: str, shape, dtype: torch.dtype, reader) -> torch.Tensor:
    """A meta tensor standing for `name`, whose bytes `reader.read()` gives when the model is
    filled (models/materialize.py)."""
    tensor = torch.empty(shape, dtype=dtype, device="meta")
    origins[name] = (weakref.ref(tensor), reader)
    return tensor


def stack_reads(rows: list[list[torch.Tensor]], origins: Origins | None, name: str):
    """`torch.stack([torch.cat(r) for r in rows])` as a meta tensor whose bytes are read later
    (origins[name] says how, models/materialize.py), when every part is a file read the loader
    recorded with one dtype; None otherwise (the caller stacks the tensors themselves)."""
    if not origins or len({t.dtype for r in rows for t in r}) != 1:
        return None
    reads = file_reads(origins)
    parts, first = [], rows[0]
    for expert, tensors in enumerate(rows):
        if [t.shape for t in tensors] != [t.shape for t in first]:
            return None
        row = 0
        for t in tensors:
            if id(t) not in reads:
                return None
            parts.append((expert, row, t.shape[0], reads[id(t)]))
            row += t.shape[0]
    shape = (len(rows), sum(t.shape[0] for t in first), *first[0].shape[1:])
    dtype = first[0].dtype
    return lazy_tensor(origins, name, shape, dtype, StackedRead(shape, dtype, tuple(parts)))


def note_origin(origins: Origins | None, tensor: torch.Tensor, where: FileTensor) -> None:
    """Record where `tensor` (a mapped read) came from; models/materialize.py reads it again from
    there only if the loader still holds that very tensor (nothing rewrote it)."""
    if origins is not None:
        origins[where.name] = (weakref.ref(tensor), where)


def _open(file: Path, backend: str = "mmap"):
    try:
        return safe_open(str(file), framework="pt", device="cpu", backend=backend)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({exc})") from exc


def read_tensors(files: list[Path], origins: Origins | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint by name (memory-mapped, checkpoint dtype, on CPU); where
    each came from goes into `origins`."""
    tensors: dict[str, torch.Tensor] = {}
    for file, name, tensor in iter_tensors(files):
        if name in tensors:
            raise ModelLoadError(f"tensor {name!r} appears twice (again in {file.name})")
        tensors[name] = tensor
        note_origin(origins, tensor, FileTensor(file, name))
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
