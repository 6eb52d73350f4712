"""Load a GGUF checkpoint directly (`--model file.gguf`, or a folder holding one GGUF and no
safetensors), read with the `gguf` package, without an fp32 copy of the quantized weights.

Tensor types: F32 / F16 / BF16 load as they are. Q4_0 / Q4_1 blocks (32 values, one scale and
offset) are re-packed exactly into the int4 path (`quantization="auto"`: w = (q - 8) * scale +
zero with the file's codes: Q4_0 scale d, zero 0; Q4_1 scale d, zero m + 8 d). Q8_0 goes to
the int8 path (re-quantized per output channel from its values). Other types gguf can decode
(Q4_K, Q5_K, Q6_K, ...) are dequantised to the serving dtype with one warning naming the type;
types it cannot decode are an error naming the tensor and type. `quantization="none"` serves
every tensor dequantised, `int8` / `int4` re-quantize whatever the file holds.

The config and the tokenizer (with the chat template) come from the GGUF metadata through
transformers, written once to a small sidecar folder in the cache (config.json + tokenizer files,
no weights) that the engine reads like any model folder. Architectures: llama (and Mistral /
SmolLM, which llama.cpp files as llama), qwen2, qwen3.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

from models.errors import ModelLoadError

logger = logging.getLogger(__name__)

ARCHITECTURES = {
    "llama": "LLAMA",
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
}  # GGUF name -> gguf.MODEL_ARCH
INT4_TYPES = ("Q4_0", "Q4_1")
INT8_TYPES = ("Q8_0",)
AS_IS_TYPES = ("F32", "F16", "BF16")


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names, or the single GGUF of a folder with no safetensors; else None."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not any(path.glob("*.safetensors")):
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise ModelLoadError(
                f"{path} holds several GGUF files ({names}); pass one with --model"
            )
        return files[0] if files else None
    return None


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types and field.types[0].name == "STRING" else value[0]


def sidecar_folder(file: Path) -> Path:
    """config.json + tokenizer from the GGUF metadata, written once per file (size + mtime)."""
    from models.default_model import cache_root

    stat = file.stat()
    key = hashlib.sha1(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[
        :12
    ]
    folder = cache_root() / "gguf" / f"{file.stem}-{key}"
    if (folder / "tokenizer_config.json").is_file():
        return folder
    from transformers import AutoConfig, AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    try:
        AutoConfig.from_pretrained(file.parent, gguf_file=file.name).save_pretrained(folder)
        AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name).save_pretrained(folder)
    except Exception as exc:  # transformers' GGUF parsers raise many types
        raise ModelLoadError(f"{file}: cannot read its config/tokenizer metadata ({exc})") from exc
    return folder


def _llama_unpermute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its convert script interleaves rope halves)."""
    dim = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def int4_blocks(
    data: np.ndarray, type_name: str, shape
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 / Q4_1 bytes [N, K/32 * block] -> codes [N, K] (0..15), scales, zeros [N, K/32] fp32."""
    n, k = shape
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


BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per 32-value block


def _cut_raw(data: np.ndarray, type_name: str, spec):
    """A tensor-parallel rank's rows, or whole-block columns, of a tensor's raw GGUF data
    [N, row bytes or values], before anything is decoded; returns it and what is still to cut
    after decoding (the vocab pad rows; everything when columns would split a block)."""
    if spec is None:
        return data, None
    dim, start, length, pad = spec
    if dim == 0:
        return data[start : start + length], (0, 0, length, pad) if pad else None
    if type_name in AS_IS_TYPES:
        return data[:, start : start + length], None
    if type_name in BLOCK_BYTES and start % 32 == 0 and length % 32 == 0:
        size = BLOCK_BYTES[type_name]
        return data[:, start // 32 * size : (start + length) // 32 * size], None
    return data, spec  # other block layouts: decoded whole, then cut


def _finish_cut(tensor: torch.Tensor, spec) -> torch.Tensor:
    if spec is None:
        return tensor
    from models.safetensors_io import pad_along

    dim, start, length, pad = spec
    return pad_along(tensor.narrow(dim, start, length), dim, pad).contiguous()


def read_weights(
    file: Path, expected: dict, hf_config, dtype: torch.dtype, quantization: str, slices=None
):
    """(dense state dict in `dtype`, int4 sources {name: (codes, scales, zeros)}, chosen mode).

    slices: name -> (dim, start, length, pad), a tensor-parallel rank's part of each tensor
    (torch_runner/distributed/shard.py): only those rows / blocks are decoded and re-packed."""
    import gguf

    from models.quantize import return_freed_memory

    reader = gguf.GGUFReader(str(file))
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{file}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    name_map = gguf.get_tensor_name_map(
        getattr(gguf.MODEL_ARCH, ARCHITECTURES[arch]), hf_config.num_hidden_layers
    )
    tensors = {t.name: t for t in reader.tensors}
    weights, sources, types, warned = {}, {}, set(), set()
    for name, shape in expected.items():
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if name == "lm_head.weight" and gguf_name not in tensors:
            gguf_name = "token_embd.weight"  # tied files store the embedding once
        if gguf_name not in tensors:
            raise ModelLoadError(f"{file}: GGUF has no tensor {gguf_name!r} (for {name})")
        t = tensors[gguf_name]
        type_name = t.tensor_type.name
        types.add(type_name)
        heads = None
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = (
                hf_config.num_attention_heads
                if ".q_proj." in name
                else hf_config.num_key_value_heads
            )
        spec = (slices or {}).get(name)
        raw = np.asarray(t.data)
        raw = raw.view(np.int16) if type_name == "BF16" else raw  # one element per column
        data, later = _cut_raw(raw, type_name, spec)
        if spec is not None and later != spec:  # cut before decoding: this rank's shape
            rows = shape[0] if spec[0] else spec[2]
            if heads:
                heads = heads * rows // shape[0]  # a rank's rows are whole heads
            shape = (rows, *shape[1:]) if spec[0] == 0 else (rows, spec[2], *shape[2:])
        if type_name in INT4_TYPES and quantization in ("auto", "int4") and len(shape) == 2:
            if later is not None and later[0]:
                raise ModelLoadError(
                    f"{file}: the {name} shard (columns {spec[1]}..{spec[1] + spec[2]}) would "
                    "split the GGUF's 32-value Q4 blocks"
                )
            codes, scales, zeros = int4_blocks(data, type_name, shape)
            if heads:
                codes, scales, zeros = (_llama_unpermute(a, heads) for a in (codes, scales, zeros))
            sources[name] = tuple(
                _finish_cut(torch.from_numpy(np.ascontiguousarray(a)), later)
                for a in (codes, scales, zeros)
            )
            codes, scales, zeros = sources[name]
            dense = (codes.float().reshape(codes.shape[0], -1, 32) - 8) * scales[..., None]
            weights[name] = (dense + zeros[..., None]).reshape(codes.shape).to(dtype)
            del dense
            if len(weights) % 16 == 0:
                return_freed_memory()
            continue
        if type_name == "BF16":
            values = torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(
                torch.bfloat16
            )
        elif type_name in ("F32", "F16"):
            values = torch.from_numpy(np.array(data))  # a copy: the file stays read-only
        else:
            if type_name not in INT8_TYPES + INT4_TYPES and type_name not in warned:
                warned.add(type_name)
                logger.warning(
                    "GGUF tensor type %s has no packed kernel here: dequantised to %s",
                    type_name,
                    dtype,
                )
            try:
                values = torch.from_numpy(
                    gguf.quants.dequantize(np.ascontiguousarray(data), t.tensor_type).copy()
                )
            except NotImplementedError as exc:
                raise ModelLoadError(
                    f"{file}: tensor {gguf_name!r} has GGUF type {type_name}, which cannot be decoded ({exc})"
                ) from exc
        values = values.reshape(shape)
        if heads:
            values = torch.from_numpy(_llama_unpermute(values.float().numpy(), heads))
        weights[name] = _finish_cut(values, later).to(dtype)
        if len(weights) % 16 == 0:
            return_freed_memory()  # the decode temporaries; glibc keeps them otherwise
    if quantization == "auto":
        linear_types = {tensors[name_map.get_name(n, try_suffixes=(".weight",))].tensor_type.name
                        for n in expected if n.endswith("proj.weight")}  # fmt: skip
        quantization = (
            "int4"
            if linear_types & set(INT4_TYPES)
            else "int8"
            if linear_types & set(INT8_TYPES)
            else "none"
        )
    head_name = name_map.get_name("lm_head.weight", try_suffixes=(".weight",))
    head_type = tensors.get(head_name, tensors["token_embd.weight"]).tensor_type.name
    head_mode = "int4" if head_type in INT4_TYPES else "int8" if head_type in INT8_TYPES else "none"
    logger.info(
        "GGUF %s (%s): tensor types %s -> quantization=%s",
        file.name,
        arch,
        sorted(types),
        quantization,
    )
    return weights, sources, quantization, head_mode


def auto_dtype(file: Path) -> str:
    """A float GGUF keeps its dtype; a quantized one serves bf16 activations (no fp32 copy)."""
    import gguf

    reader = gguf.GGUFReader(str(file))
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    if kinds <= {"F32"}:
        return "float32"
    if kinds <= {"F32", "F16"}:
        return "float16"
    return "bfloat16"


def load_gguf_model(file: Path, *, device, dtype: str, quantization: str, shard=None):
    """`models.load_model` for a GGUF file: same checks, same LoadedModel (path = the sidecar).

    shard: a tensor-parallel plan (models.loader.load_model): only this rank's rows, or whole
    32-value blocks of columns, of each tensor are decoded and re-packed (`read_weights`), Q4
    codes/scales/zeros included; the rank-0-only biases are zeroed on the others."""
    from models import loader
    from models.layers import fuse_projections
    from models.quantize import quantize_linears, return_freed_memory
    from models.registry import get_family

    folder = sidecar_folder(file)
    raw = loader.read_config(folder)
    family = get_family(raw["model_type"])
    hf_config = loader._hf_config(folder)
    try:
        args = family.ModelArgs.from_hf_config(hf_config)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{file}: {exc}") from exc
    target_dtype = loader.DTYPES[auto_dtype(file) if dtype == "auto" else dtype]
    torch_device = loader.resolve_device(device)
    with torch.device("meta"):
        model = family.Model(args)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    slices = None
    if shard is not None:
        shard.prepare(model)
        slices = {name: cut.spec for name, cut in shard.slices.items() if hasattr(cut, "spec")}
    weights, sources, mode, head_mode = read_weights(
        file, expected, hf_config, target_dtype, quantization, slices
    )
    if shard is not None:
        shard.presliced.update(slices)
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        weights = {name: shard.shard_tensor(name, t) for name, t in weights.items()}
    loader.check_weights(expected, weights)
    state = {k: v.to(torch_device) for k, v in weights.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.to(torch_device)
    model.eval().requires_grad_(False)
    fuse_projections(model)
    if mode != "none":
        loader.check_quantization_runs(mode, torch_device, target_dtype)
        sources = {k: tuple(a.to(torch_device) for a in v) for k, v in sources.items()}
        quantize_linears(
            model, mode, int4_sources=sources if mode == "int4" else None,
            head_mode=head_mode if quantization == "auto" else None, shard=shard,
        )  # fmt: skip
    del weights, state, sources  # the dense / int32-code copies the packed weights replaced
    return_freed_memory()
    logger.info(
        "loaded %s from %s on %s as %s (%s)",
        raw["model_type"],
        file,
        torch_device,
        target_dtype,
        mode,
    )
    return loader.LoadedModel(
        model=model, args=args, hf_config=hf_config, path=folder,
        eos_token_ids=loader.eos_token_ids({}, raw), generation_config={},
    )  # fmt: skip
