"""A GGUF file's header (scalar metadata, tensor table) and its tensors' rows read with pread.

Why not `gguf.GGUFReader`: it turns every metadata array element into a numpy view, so the
default model's tokenizer arrays (49k tokens, 49k merges) took 8 s and 157 MB of anonymous memory
per reader, held through the whole weight decode; and reading tensors through its memory map
leaves every touched page resident (98 MB of file pages on top of the decoded weights). Here
arrays are skipped, and `read_rows` preads rows into fresh buffers, so neither stays resident.
Little-endian GGUF v2 / v3 only (what llama.cpp writes); anything else is an error naming it.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from models.errors import ModelLoadError
from models.safetensors_io import pad_along
from ops.quant.int_linear import quantize_int8

# GGUF metadata value types -> struct format (8: string, 9: array are read apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # fmt: skip
STRING, ARRAY = 8, 9
ROW_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}  # one element a column
DEFAULT_ALIGNMENT = 32
TILE_BYTES = 4 << 20  # fp32 bytes decoded at a time into a dense tensor (`read_dense`)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: numpy-order `shape` ([rows, columns] for a matrix), its GGML type
    and where its bytes are (absolute offset); a row is `row_bytes` bytes of whole blocks."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    qtype: int
    offset: int
    block_size: int
    type_size: int

    @property
    def row_bytes(self) -> int:
        return self.shape[-1] // self.block_size * self.type_size

    @property
    def num_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64))


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict  # scalar and string metadata (arrays are skipped)
    tensors: dict[str, TensorInfo]


class _Cursor:
    """Reads the header through a buffered file: skipped arrays are seeks, nothing is kept."""

    def __init__(self, file, path: Path):
        self.file, self.path = file, path

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        data = self.file.read(size)
        if len(data) != size:
            raise ModelLoadError(f"{self.path}: truncated GGUF header")
        return struct.unpack("<" + fmt, data)[0]

    def string(self) -> str:
        size = self.take("Q")
        data = self.file.read(size)
        if len(data) != size:
            raise ModelLoadError(f"{self.path}: truncated GGUF header")
        return data.decode("utf-8", errors="replace")

    def skip_array(self) -> None:
        kind, count = self.take("I"), self.take("Q")
        if kind == STRING:
            for _ in range(count):
                self.file.seek(self.take("Q"), os.SEEK_CUR)
        elif kind in SCALARS:
            self.file.seek(count * struct.calcsize(SCALARS[kind]), os.SEEK_CUR)
        else:  # arrays of arrays: not in llama.cpp's files
            raise ModelLoadError(
                f"{self.path}: GGUF metadata array of type {kind} is not supported"
            )

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            return self.skip_array()
        if kind not in SCALARS:
            raise ModelLoadError(f"{self.path}: unknown GGUF metadata value type {kind}")
        return self.take(SCALARS[kind])


def read_header(path: Path) -> GGUFHeader:
    """The metadata scalars and the tensor table of the GGUF at `path` (no tensor data read)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        cur = _Cursor(f, path)
        magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r})")
        version = cur.take("I")
        if version not in (2, 3):
            raise ModelLoadError(
                f"{path}: GGUF version {version} is not supported; supported: 2, 3 (little-endian)"
            )
        num_tensors, num_fields = cur.take("Q"), cur.take("Q")
        fields = {}
        for _ in range(num_fields):
            key = cur.string()
            value = cur.value(cur.take("I"))
            if value is not None:
                fields[key] = value
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            dims = [cur.take("Q") for _ in range(cur.take("I"))]
            infos.append((name, tuple(reversed(dims)), cur.take("I"), cur.take("Q")))
        alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-f.tell() // alignment) * alignment
    tensors = {}
    for name, shape, qtype, offset in infos:
        try:
            kind = GGMLQuantizationType(qtype)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name!r} has unknown GGML type {qtype}") from None
        block_size, type_size = GGML_QUANT_SIZES[kind]
        tensors[name] = TensorInfo(name, shape, kind.name, qtype, start + offset, block_size,
                                   type_size)  # fmt: skip
    return GGUFHeader(fields, tensors)


def read_rows(fd: int, info: TensorInfo, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows [start, stop) of a matrix (all of a vector), as stored: [rows, columns] of F32 /
    F16 / BF16 (BF16 as int16 bit patterns), else [rows, row_bytes] uint8 blocks. A fresh buffer
    read with pread: the file's pages never count in this process's resident memory."""
    if len(info.shape) == 1:  # a vector: one row
        start, stop = 0, 1
        shape = info.shape if info.type_name in ROW_DTYPES else (info.row_bytes,)
    else:
        stop = info.num_rows if stop is None else stop
        shape = (stop - start, info.shape[-1] if info.type_name in ROW_DTYPES else info.row_bytes)
    out = np.empty(shape, ROW_DTYPES.get(info.type_name, np.uint8))
    size = out.nbytes
    if size and os.preadv(fd, [out], info.offset + start * info.row_bytes) != size:
        raise ModelLoadError(f"GGUF tensor {info.name!r}: the file ends inside its data")
    return out


def int4_blocks(data: np.ndarray, type_name: str, shape) -> tuple[np.ndarray, ...]:
    """Q4_0 / Q4_1 / Q4_K rows [N, row_bytes] -> codes [N, K] uint8 (0..15) and scales, zeros
    [N, K/32] fp32 with w = (q - 8) * scale + zero: the file's own codes, re-packed exactly.
    Q4_0: scale d, zero 0 (it stores q - 8); Q4_1: scale d, zero m + 8 d; Q4_K (256-value
    super-blocks of eight 32-value groups, 6-bit group scales and mins): scale d * sc,
    zero 8 * scale - dmin * m."""
    n, k = shape
    if type_name == "Q4_K":
        return _q4_k_blocks(data, n, k)
    header = 2 if type_name == "Q4_0" else 4
    blocks = data.reshape(n, k // 32, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., header:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)  # low nibbles first
    if type_name == "Q4_0":
        zeros = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros = m + 8 * d
    return codes, d, zeros


def _q4_k_blocks(data: np.ndarray, n: int, k: int) -> tuple[np.ndarray, ...]:
    blocks = data.reshape(n, k // 256, 144)  # d, dmin (f16), 12 bytes of scales/mins, 128 of qs
    d = blocks[..., 0:2].copy().view(np.float16)[..., :1].astype(np.float32)  # [N, K/256, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., :1].astype(np.float32)
    packed = blocks[..., 4:16].reshape(n, k // 256, 3, 4)  # the layout gguf.quants.Q4_K unpacks
    lo, hi, both = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # [N, K/256, 8]
    mins = np.concatenate([hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    scales = d * sc.astype(np.float32)
    zeros = 8 * scales - dmin * mins.astype(np.float32)
    qs = blocks[..., 16:].reshape(n, k // 256, 4, 1, 32)  # 4 chunks of 64 values
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-2)  # chunk c: group 2c low, 2c+1 high
    return codes.reshape(n, k), scales.reshape(n, k // 32), zeros.reshape(n, k // 32)


def llama_unpermute(rows, num_heads: int):
    """Undo llama.cpp's q/k row permutation (its convert script interleaves rope halves)."""
    dim = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def rank_rows(t: TensorInfo, spec) -> tuple[int, int, int]:
    """(first row, stop row, zero rows appended) of a matrix's raw rows for this rank."""
    if spec is not None and spec[0] == 0:
        _, start, length, pad = spec
        return start, start + length, pad
    return 0, t.num_rows, 0


def cut_columns(raw: np.ndarray, t: TensorInfo, spec):
    """A rank's columns of raw rows: cut here when they are whole blocks, else (raw, (start,
    length)) for the caller to cut after decoding (e.g. a K-quant's 256-value blocks)."""
    if spec is None or spec[0] != 1:
        return raw, None
    _, start, length, _ = spec
    if t.type_name in ROW_DTYPES:
        return raw[:, start : start + length], None
    size = t.block_size
    if start % size == 0 and length % size == 0:
        return raw[:, start // size * t.type_size : (start + length) // size * t.type_size], None
    return raw, (start, length)


def _decode(raw: np.ndarray, t: TensorInfo) -> torch.Tensor:
    """Raw rows -> values: F32 / F16 / BF16 as they are, other types through gguf's decoder."""
    if t.type_name == "BF16":
        return torch.from_numpy(raw).view(torch.bfloat16)
    if t.type_name in ROW_DTYPES:
        return torch.from_numpy(raw)
    import gguf

    try:
        return torch.from_numpy(gguf.quants.dequantize(raw, t.qtype))
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"tensor {t.name!r} has GGUF type {t.type_name}, which cannot be decoded ({exc})"
        ) from exc


def dense_tiles(fd: int, t: TensorInfo, spec):
    """(first row, values [rows, columns] fp32 or as stored) of a matrix for this rank, decoded
    TILE_BYTES of fp32 at a time (every GGUF type decodes row by row, so tiles change nothing)."""
    first, stop, _ = rank_rows(t, spec)
    step = max(1, TILE_BYTES // (4 * t.shape[-1]))
    for row in range(first, stop, step):
        end = min(row + step, stop)
        raw, later = cut_columns(read_rows(fd, t, row, end), t, spec)
        values = _decode(raw, t)
        del raw
        yield row - first, values if later is None else values[:, later[0] : later[0] + later[1]]


def _rank_shape(shape, spec) -> tuple[int, ...]:
    if spec is None:
        return tuple(shape)
    dim, _, length, pad = spec
    return (*shape[:dim], length + pad, *shape[dim + 1 :])


def read_dense(fd: int, t: TensorInfo, shape, spec, heads, dtype: torch.dtype) -> torch.Tensor:
    """A tensor's values in `dtype` for this rank, decoded a tile at a time into the result."""
    shape = _rank_shape(shape, spec)
    if len(t.shape) == 1:  # a norm or bias vector: small, decoded whole
        out = _decode(read_rows(fd, t), t)
        if spec is not None:
            out = pad_along(out.narrow(0, spec[1], spec[2]), 0, spec[3])
        out = out.to(dtype)
    else:
        first, stop, pad = rank_rows(t, spec)
        cols = spec[2] if spec is not None and spec[0] == 1 else t.shape[-1]
        out = torch.empty(stop - first + pad, cols, dtype=dtype)
        out[stop - first :].zero_()
        for row, values in dense_tiles(fd, t, spec):
            out[row : row + len(values)].copy_(values)
    if heads:
        out = llama_unpermute(out, heads).contiguous()
    if out.numel() != int(np.prod(shape)):
        raise ModelLoadError(f"tensor {t.name!r} has shape {t.shape}; expected {tuple(shape)}")
    return out.reshape(shape)


def read_int8(fd: int, t: TensorInfo, shape, heads, dtype: torch.dtype):
    """A whole matrix as per-row int8 (qweight [N, K] int8, scales [N] in `dtype`), each tile
    quantized from its values in `dtype` as it is decoded: the same codes and scales as
    `quantize_int8` of the dense tensor (per row), without the dense tensor."""
    if len(t.shape) != 2 or t.shape != tuple(shape):
        raise ModelLoadError(f"tensor {t.name!r} has shape {t.shape}; expected {tuple(shape)}")
    qweight = torch.empty(shape, dtype=torch.int8)
    scales = torch.empty(shape[0], dtype=dtype)
    for row, values in dense_tiles(fd, t, None):
        part = quantize_int8(values.to(dtype))
        qweight[row : row + len(values)], scales[row : row + len(values)] = (
            part.qweight,
            part.scales,
        )
    if heads:  # a row permutation: it commutes with per-row quantization
        qweight, scales = (llama_unpermute(a, heads).contiguous() for a in (qweight, scales))
    return qweight, scales
