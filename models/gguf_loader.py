"""Load a GGUF checkpoint directly (`--model file.gguf`, or a folder holding one GGUF and no
safetensors), quantized as read: no dense copy of a quantized weight is ever built.

Tensor types: F32 / F16 / BF16 load as they are. Q4_0 / Q4_1 / Q4_K blocks go straight from
the file's bytes to the int4 path's codes, scales and zeros, tensor by tensor
(models/gguf_file.py `int4_blocks`: the file's own codes, w = (q - 8) * scale + zero, exact), and
their dense weights are never made (`quantization="auto"`). Q8_0 goes to the int8 path
(re-quantized per output channel from its values). Other types gguf can decode (Q5_K, Q6_K, ...)
are dequantised to the serving dtype with one warning naming the type; types it cannot decode are
an error naming the tensor and type. Every dense tensor is decoded a row tile at a time straight
into its result, so the temporaries stay at one tile. `quantization="none"` serves every tensor
dequantised, `int8` / `int4` re-quantize whatever the file holds.

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
from models.gguf_file import (
    TensorInfo,
    cut_columns,
    int4_blocks,
    llama_unpermute,
    rank_rows,
    read_dense,
    read_header,
    read_int8,
    read_rows,
)
from models.quantize import FUSED_GROUPS, INT4_GROUP_SIZE
from models.safetensors_io import pad_along

logger = logging.getLogger(__name__)

ARCHITECTURES = {
    "llama": "LLAMA",
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
}  # GGUF name -> gguf.MODEL_ARCH
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
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


def _read_int4(fd: int, t: TensorInfo, spec, heads, name: str, file: Path):
    """A Q4 matrix's (codes uint8 [N, K], scales, zeros [N, K/32] fp32) for this rank, from its
    blocks: no dense copy (the temporaries are a few times the codes of this one tensor)."""
    first, stop, pad = rank_rows(t, spec)
    raw, later = cut_columns(read_rows(fd, t, first, stop), t, spec)
    group = INT4_GROUP_SIZE
    if later is not None and (later[0] % group or later[1] % group):
        raise ModelLoadError(
            f"{file}: the {name} shard (columns {spec[1]}..{spec[1] + spec[2]}) would "
            f"split the GGUF's {group}-value Q4 groups"
        )
    k = raw.shape[1] // t.type_size * t.block_size
    codes, scales, zeros = int4_blocks(raw, t.type_name, (raw.shape[0], k))
    if later is not None:  # whole groups of a K-quant's super-blocks
        start, stop = later[0], later[0] + later[1]
        codes = codes[:, start:stop]
        scales, zeros = (
            scales[:, start // group : stop // group],
            zeros[:, start // group : stop // group],
        )
    if heads:
        codes, scales, zeros = (llama_unpermute(a, heads) for a in (codes, scales, zeros))
    return tuple(
        pad_along(torch.from_numpy(np.ascontiguousarray(a)), 0, pad) for a in (codes, scales, zeros)
    )


def read_weights(
    file: Path,
    expected: dict,
    hf_config,
    dtype: torch.dtype,
    quantization: str,
    slices=None,
    int8_into: dict | None = None,
):
    """(dense state dict in `dtype`, int4 sources {name: (codes, scales, zeros)}, chosen mode,
    the head's mode). A decoder linear or lm_head stored as Q4 (with quantization auto / int4)
    is read as int4 codes only and has no entry in the dense state dict.

    slices: name -> (dim, start, length, pad), a tensor-parallel rank's part of each tensor
    (torch_runner/distributed/shard.py): only those rows / blocks are read and decoded.
    int8_into: a dict that, when given (an unsharded load), receives every linear the int8 mode
    will quantize, quantized per row as read (name -> (qweight, scales), `read_int8`), with no
    entry in the dense state dict either. Sharded int8 needs the ranks' whole-row maxima, so
    a sharded load reads those dense (quantize_linears quantizes them)."""
    import gguf

    from models.quantize import return_freed_memory

    header = read_header(file)
    arch = header.fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{file}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    name_map = gguf.get_tensor_name_map(
        getattr(gguf.MODEL_ARCH, ARCHITECTURES[arch]), hf_config.num_hidden_layers
    )
    tensors = header.tensors
    mode, head_mode = _modes(tensors, name_map, expected, quantization)
    head = head_mode if quantization == "auto" and mode != "none" else mode  # as packed
    weights, sources, types, warned = {}, {}, set(), set()
    with open(file, "rb") as f:
        for name, shape in expected.items():
            gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
            if name == "lm_head.weight" and gguf_name not in tensors:
                gguf_name = "token_embd.weight"  # tied files store the embedding once
            if gguf_name not in tensors:
                raise ModelLoadError(f"{file}: GGUF has no tensor {gguf_name!r} (for {name})")
            t = tensors[gguf_name]
            types.add(t.type_name)
            heads = None
            if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
                heads = (
                    hf_config.num_attention_heads
                    if ".q_proj." in name
                    else hf_config.num_key_value_heads
                )
            spec = (slices or {}).get(name)
            if spec is not None and spec[0] == 0 and heads:
                heads = heads * spec[2] // shape[0]  # a rank's rows are whole heads
            is_linear = name.endswith("proj.weight") or name == "lm_head.weight"
            if t.type_name in INT4_TYPES and quantization in ("auto", "int4") and is_linear:
                sources[name] = _read_int4(f.fileno(), t, spec, heads, name, file)
                continue
            linear_mode = head if name == "lm_head.weight" else mode
            if int8_into is not None and is_linear and linear_mode == "int8" and slices is None:
                int8_into[name] = read_int8(f.fileno(), t, shape, heads, dtype)
                return_freed_memory()
                continue
            if (
                t.type_name not in INT8_TYPES + INT4_TYPES + AS_IS_TYPES
                and t.type_name not in warned
            ):
                warned.add(t.type_name)
                logger.warning(
                    "GGUF tensor type %s has no packed kernel here: dequantised to %s",
                    t.type_name,
                    dtype,
                )
            try:
                weights[name] = read_dense(f.fileno(), t, shape, spec, heads, dtype)
            except ModelLoadError as exc:
                raise ModelLoadError(f"{file}: {exc}") from exc
            return_freed_memory()  # the decode tiles; glibc keeps them otherwise
    logger.info(
        "GGUF %s (%s): tensor types %s -> quantization=%s", file.name, arch, sorted(types), mode
    )
    return weights, sources, mode, head_mode


def _modes(tensors: dict, name_map, expected: dict, quantization: str) -> tuple[str, str]:
    """(the linears' mode, the lm_head's own mode) from the file's tensor types: auto is int4
    when any linear is Q4, else int8 when any is Q8_0, else none; the head follows its type."""
    mode = quantization
    if quantization == "auto":
        linear_types = {tensors[name_map.get_name(n, try_suffixes=(".weight",))].type_name
                        for n in expected if n.endswith("proj.weight")}  # fmt: skip
        mode = (
            "int4"
            if linear_types & set(INT4_TYPES)
            else "int8"
            if linear_types & set(INT8_TYPES)
            else "none"
        )
    head_name = name_map.get_name("lm_head.weight", try_suffixes=(".weight",))
    head_type = tensors.get(head_name, tensors["token_embd.weight"]).type_name
    head_mode = "int4" if head_type in INT4_TYPES else "int8" if head_type in INT8_TYPES else "none"
    return mode, head_mode


def _densify_unpacked(sources: dict, weights: dict, dtype: torch.dtype, mode: str, head: str):
    """Give back as dense weights the int4 sources quantize_linears will not pack: a part of a
    fused q/k/v or gate/up matrix whose siblings are not Q4 (a Q4_K_M file's Q6_K v_proj: the
    fused matrix is re-quantized from dense), any when the mode is not int4 (an lm_head alone)."""
    for name in list(sources):
        group = next((g for g in FUSED_GROUPS if any(f".{p}." in name for p in g)), ())
        part = next((p for p in group if f".{p}." in name), "")
        siblings = [name.replace(f".{part}.", f".{p}.") for p in group]
        is_packed = (head if name == "lm_head.weight" else mode) == "int4"
        if is_packed and all(s in sources for s in siblings):
            continue
        codes, scales, zeros = sources.pop(name)
        dense = (codes.float().reshape(codes.shape[0], -1, INT4_GROUP_SIZE) - 8) * scales[..., None]
        weights[name] = (dense + zeros[..., None]).reshape(codes.shape).to(dtype)


def auto_dtype(file: Path) -> str:
    """A float GGUF keeps its dtype; a quantized one serves bf16 activations (no fp32 copy)."""
    kinds = {t.type_name for t in read_header(file).tensors.values() if len(t.shape) == 2}
    if kinds <= {"F32"}:
        return "float32"
    if kinds <= {"F32", "F16"}:
        return "float16"
    return "bfloat16"


def _to_device(model: torch.nn.Module, device: torch.device) -> None:
    """`model.to(device)` that leaves the meta placeholders of int4-sourced weights alone."""
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for key, value in slots.items():
                if value is not None and not value.is_meta and value.device != device:
                    moved = value.to(device)
                    is_param = isinstance(value, torch.nn.Parameter)
                    slots[key] = (
                        torch.nn.Parameter(moved, requires_grad=False) if is_param else moved
                    )


def load_gguf_model(file: Path, *, device, dtype: str, quantization: str, shard=None):
    """`models.load_model` for a GGUF file: same checks, same LoadedModel (path = the sidecar).

    A Q4 linear is loaded as a meta placeholder beside its int4 codes, which quantize_linears
    packs (fused per q/k/v and gate/up) and frees one matrix at a time, so the load peaks near the
    packed weights, the dense embedding and one matrix's codes (docs/performance.md, memory).
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
    int8_sources = {} if shard is None else None  # sharded int8: quantize_linears (docstring)
    weights, sources, mode, head_mode = read_weights(
        file, expected, hf_config, target_dtype, quantization, slices, int8_sources
    )
    head = head_mode if quantization == "auto" and mode != "none" else mode
    _densify_unpacked(sources, weights, target_dtype, mode, head)
    for name, (codes, *_) in [*sources.items(), *(int8_sources or {}).items()]:
        weights[name] = torch.empty(codes.shape, dtype=target_dtype, device="meta")  # never dense
    if shard is not None:
        shard.presliced.update(slices)
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        weights = {name: shard.shard_tensor(name, t) for name, t in weights.items()}
    loader.check_weights(expected, weights)
    state = {k: v if v.is_meta else v.to(torch_device) for k, v in weights.items()}
    del weights
    model.load_state_dict(state, strict=True, assign=True)
    del state  # each part is freed as fuse_projections replaces it by its fused slice
    _to_device(model, torch_device)  # the non-persistent rope tables were built on CPU
    model.eval().requires_grad_(False)
    fuse_projections(model)
    return_freed_memory()
    if mode != "none":
        loader.check_quantization_runs(mode, torch_device, target_dtype)
        sources, int8_sources = (
            {k: tuple(a.to(torch_device) for a in v) for k, v in d.items()}
            for d in (sources, int8_sources or {})
        )
        quantize_linears(
            model, mode, int4_sources=sources,  # a Q4 lm_head beside int8 linears too
            head_mode=head_mode if quantization == "auto" else None, shard=shard,
            int8_sources=int8_sources,
        )  # fmt: skip
    del sources, int8_sources  # emptied by quantize_linears as it packed them
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
