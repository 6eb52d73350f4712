"""Load a Hugging Face model folder into a family `Model`, failing early with a clear message.

Order matters: every check that can fail (path, config.json, model_type, required fields,
checkpoint files, tensor names, shapes and dtypes) runs before a single weight is copied, so a broken
folder is reported in one line before the server starts. The model is built on the `meta`
device (no memory, no init); the checks run on memory-mapped safetensors (no page touched), then
models/materialize.py reads each tensor again with pread straight into its parameter (the fused
q/k/v and gate/up buffers included), so a load peaks near the weights it keeps, and nothing is
ever unpickled. Each tensor is checked finite after its cast (models/weight_checks.py), so a NaN
checkpoint never reaches the server.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bridge import resolve_device
from models import safetensors_io, weight_checks
from models.errors import ModelLoadError
from models.layers import fuse_projections
from models.materialize import materialize
from models.quantize import QUANTIZATIONS, quantize_linears
from models.registry import get_family

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALLOWED_DTYPES = ("auto", *DTYPES)
LOAD_FORMATS = ("safetensors", "dummy")
MOE_WEIGHTS = ("packed", "dequantized")  # quantized MoE experts: as on disk, or expanded at load
DUMMY_STD = 0.02
DUMMY_SEED = 0
DUMMY_MXFP4_SCALE = 120  # 2^-7: E2M1 codes (|v| <= 6) times it have a std near DUMMY_STD
# tensors some checkpoints carry that are recomputed here, never loaded
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    """A ready model plus what the engine needs around it (tokenizer files live at `path`)."""

    model: torch.nn.Module
    args: Any
    hf_config: Any
    path: Path
    eos_token_ids: list[int] = field(default_factory=list)
    generation_config: dict[str, Any] = field(default_factory=dict)


def load_model(
    path: str | Path,
    *,
    device: str | torch.device,
    dtype: str = "auto",
    load_format: str = "safetensors",
    moe_weights: str = "packed",
    quantization: str = "auto",
    shard=None,
) -> LoadedModel:
    """Load the HF folder at `path` onto `device`.

    dtype: "auto" (config `dtype`/`torch_dtype`, else the checkpoint's), "float32", "bfloat16",
    "float16". load_format: "safetensors", or "dummy" for seeded random weights built from the
    config alone (benchmarking a geometry without its checkpoint). moe_weights: "packed" keeps
    MXFP4 experts as on disk (gpt-oss), "dequantized" expands them to `dtype` at load (the
    reference). quantization: "auto" (what the checkpoint holds: a GGUF's Q4/Q8 types, an fp8
    checkpoint's e4m3 weights (models/fp8.py), else none), "none" (an fp8 checkpoint is
    dequantised at load), "int8" / "int4" weight-only linears, or "fp8" (per-channel e4m3 at
    load; needs a CUDA GPU with fp8 matmuls) (models/quantize.py). `path` may also be
    a GGUF file or a folder holding one (models/gguf_loader.py). shard: a tensor-parallel plan
    (torch_runner/distributed/shard.py) whose `prepare(model)` reshapes the meta model to one
    rank's part and whose `shard_tensor(name, tensor)` slices each checkpoint tensor to it, so
    only that part is copied. Raises ModelLoadError.
    """
    if dtype not in ALLOWED_DTYPES:
        raise ModelLoadError(
            f"dtype={dtype!r} is not supported; allowed values: {', '.join(ALLOWED_DTYPES)}"
        )
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(
            f"load_format={load_format!r} is not supported; allowed values: {', '.join(LOAD_FORMATS)}"
        )
    if moe_weights not in MOE_WEIGHTS:
        raise ModelLoadError(
            f"moe_weights={moe_weights!r} is not supported; allowed values: {', '.join(MOE_WEIGHTS)}"
        )
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"quantization={quantization!r} is not supported; allowed values: "
            f"{', '.join(QUANTIZATIONS)}"
        )
    path = Path(path).expanduser()
    if (gguf_file := _gguf_file(path)) is not None:  # GGUF checkpoints: models/gguf_loader.py
        return _load_gguf(
            gguf_file, device=device, dtype=dtype, quantization=quantization, shard=shard
        )
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} does not exist or is not a directory")
    raw = read_config(path)
    family = get_family(raw["model_type"])
    check_required_fields(raw, family.ModelArgs.REQUIRED_FIELDS, path)
    hf_config = _hf_config(path)
    try:
        args = family.ModelArgs.from_hf_config(hf_config)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path / 'config.json'}: {exc}") from exc
    args.moe_weights = moe_weights
    files = safetensors_io.checkpoint_files(path) if load_format == "safetensors" else []
    target_dtype = resolve_dtype(dtype, raw, files)
    torch_device = resolve_device(device)
    fp8_format = _fp8_format(raw, path, load_format)

    with torch.device("meta"):
        model = family.Model(args)
        if shard is not None:
            shard.prepare(model)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    expected_dtypes = {name: t.dtype for name, t in model.state_dict().items()}
    fp8_scales = {}  # fp8 weight name -> its scale tensor (models/fp8.py), when kept as fp8
    origins = {}  # checkpoint name -> where its bytes are (read again by materialize)
    if load_format == "dummy":
        norm_value = getattr(family, "DUMMY_NORM_WEIGHT", 1.0)  # Gemma stores norms as 1 + w
        weights = dummy_weights(expected, target_dtype, torch_device, norm_value=norm_value)
    else:
        weights = _checkpoint_weights(family, args, files, path, shard, origins)
        if shard is not None:
            weights = _shard_weights(shard, weights, fp8_format, path, origins)
        fp8_scales = _fp8_scales(weights, fp8_format, quantization, path)
        check_weights(expected, weights)
        weight_checks.check_dtypes(expected_dtypes, weights)
    # one tensor at a time, straight into the fused q/k/v and gate/up buffers: the load peaks
    # near the weights kept plus one tensor (models/materialize.py)
    materialize(model, weights, origins, torch_device, target_dtype, keep_dtype=set(fp8_scales),
                check_finite=load_format != "dummy", desc=f"Loading {path.name}")  # fmt: skip
    del weights, origins
    model.to(torch_device)  # the non-persistent rope tables were built on CPU
    model.eval().requires_grad_(False)
    fuse_projections(model)  # what materialize could not fuse; the state dict is unchanged
    if fp8_scales:
        _apply_fp8(model, fp8_scales, fp8_format, torch_device, target_dtype, path)
    elif quantization not in ("none", "auto"):  # auto: the checkpoint's own (GGUF); else none
        _quantize(model, quantization, torch_device, target_dtype, shard)
    generation_config = read_generation_config(path)
    logger.info(
        "loaded %s (%s) from %s on %s as %s",
        raw["model_type"],
        load_format,
        path,
        torch_device,
        target_dtype,
    )
    return LoadedModel(
        model=model,
        args=args,
        hf_config=hf_config,
        path=path,
        eos_token_ids=eos_token_ids(generation_config, raw),
        generation_config=generation_config,
    )


def _gguf_file(path: Path):
    from models.gguf_loader import find_gguf

    return find_gguf(path)


def _load_gguf(file: Path, **kwargs) -> LoadedModel:
    from models.gguf_loader import load_gguf_model

    return load_gguf_model(file, **kwargs)


def check_quantization_runs(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """A ModelLoadError when this torch build cannot run `mode` for `dtype` on `device`."""
    from ops.quant.int_linear import can_run

    reason = can_run(mode, device.type, dtype)
    if reason is not None:
        raise ModelLoadError(
            f"quantization={mode!r} cannot run on {device.type} with dtype {dtype} in this torch "
            f"build ({reason})"
        )


def _quantize(model, mode: str, device: torch.device, dtype: torch.dtype, shard=None) -> None:
    if mode == "fp8":  # vLLM's rule: fp8 needs a GPU with fp8 matmuls; no silent CPU emulation
        from models.quantize import quantize_linears_fp8
        from ops.quant.fp8 import device_fp8_support

        if (reason := device_fp8_support(device)) is not None:
            raise ModelLoadError(
                f"quantization='fp8' needs a CUDA GPU with fp8 matmuls: {reason}; on this device "
                "use --quantization int8 or int4"
            )
        quantize_linears_fp8(model)
        return
    check_quantization_runs(mode, device, dtype)
    quantize_linears(model, mode, shard=shard)


def _fp8_format(raw: dict, path: Path, load_format: str):
    """The checkpoint's fp8 format (models/fp8.py), None for other checkpoints and dummy weights."""
    from models import fp8

    try:
        fmt = fp8.checkpoint_format(raw)
    except ValueError as exc:
        raise ModelLoadError(f"{path / 'config.json'}: {exc}") from exc
    return None if load_format == "dummy" else fmt


def _shard_weights(shard, weights: dict, fp8_format, path: Path, origins: dict) -> dict:
    """This rank's part of every tensor, an fp8 checkpoint's scales cut with their weights. A
    tensor sanitize left to be read later (a meta tensor: per-expert stacks, dequantized MXFP4)
    that still has to be cut is read whole now (the plan could not slice its sources)."""
    weights = {
        name: shard.shard_tensor(name, origins[name][1].read() if t.is_meta else t)
        if shard.cuts(name) else t
        for name, t in weights.items()
    }  # fmt: skip
    if fp8_format is None:
        return weights
    try:
        return shard.shard_fp8_scales(weights, fp8_format.block)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def _fp8_scales(weights: dict, fmt, quantization: str, path: Path) -> dict:
    """Pop an fp8 checkpoint's scales; kept for `auto` / `fp8`, else the weights are dequantised
    in place (`none`: the dense reference; `int8` / `int4`: re-quantized from it)."""
    if fmt is None:
        return {}
    from models import fp8

    try:
        scales = fp8.take_scales(weights, fmt)
        if quantization not in ("auto", "fp8"):
            fp8.dequantize_weights(weights, scales, fmt)
            return {}
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    return scales


def _apply_fp8(model, scales: dict, fmt, device: torch.device, dtype, path: Path) -> None:
    from models import fp8
    from ops.quant.fp8 import device_fp8_support

    if (reason := device_fp8_support(device)) is not None:
        logger.warning(
            "fp8 checkpoint on %s: %s; its linears run the reference path (dequantised to %s "
            "per matmul)",
            device,
            reason,
            dtype,
        )
    try:
        count = fp8.apply_checkpoint_fp8(model, scales, fmt, dtype)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    logger.info("fp8 checkpoint: %d linear weights kept as e4m3 (block=%s)", count, fmt.block)


def read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path} has no config.json (is it a Hugging Face model folder?)")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path} must hold a JSON object")
    if "model_type" not in raw:
        raise ModelLoadError(f"{config_path} is missing required field(s): model_type")
    return raw


def check_required_fields(raw: dict[str, Any], required: tuple[str, ...], path: Path) -> None:
    """Name every required field config.json lacks (an alias from the HF attribute_map counts)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[raw["model_type"]]  # the lazy mapping's .get() always gives None
    aliases = getattr(config_class, "attribute_map", {}) or {}
    present = (
        set(raw)
        | {aliases[k] for k in raw if k in aliases}
        | {k for k, v in aliases.items() if v in raw}
    )
    missing = [name for name in required if name not in present]
    if missing:
        raise ModelLoadError(
            f"{path / 'config.json'} is missing required field(s): {', '.join(missing)}"
        )


def _hf_config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises many types (validators, KeyError, OSError)
        raise ModelLoadError(
            f"{path / 'config.json'}: transformers cannot parse it ({exc})"
        ) from exc


def resolve_dtype(dtype: str, raw: dict[str, Any], files: list[Path]) -> torch.dtype:
    """'auto' = the config's dtype, else the checkpoint's first float tensor, else float32."""
    if dtype != "auto":
        return DTYPES[dtype]
    declared = raw.get("dtype") or raw.get("torch_dtype")
    if declared in DTYPES:
        return DTYPES[declared]
    found = safetensors_io.checkpoint_dtype(files) if files else None
    return found if found in DTYPES.values() else torch.float32


def _checkpoint_weights(
    family, args, files: list[Path], path: Path, shard=None, origins=None
) -> dict[str, torch.Tensor]:
    if shard is None:
        weights = safetensors_io.read_tensors(files, origins)
    else:  # each rank reads its slices only (torch_runner/distributed/slice_read.py)
        weights = shard.read_checkpoint(files, origins)
        weights, args = shard.shard_raw_weights(
            weights, args
        )  # per-expert tensors, before stacking
    weights = {k: v for k, v in weights.items() if not k.endswith(IGNORED_SUFFIXES)}
    if args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some tied checkpoints still store the copy
    # families that build tensors from several (per-expert stacks, MXFP4 dequantization) take
    # the record of file reads, so the built tensor is read later straight into its memory
    lazy = {"origins": origins} if getattr(family, "SANITIZE_TAKES_ORIGINS", False) else {}
    try:
        return family.sanitize(weights, args, **lazy)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def check_weights(expected: dict[str, tuple[int, ...]], weights: dict[str, torch.Tensor]) -> None:
    """Every expected tensor present with its shape, nothing extra; errors name the tensor."""
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelLoadError(
            f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:8])}"
        )
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ModelLoadError(
            f"checkpoint has {len(extra)} unexpected tensor(s): {', '.join(extra[:8])}"
        )
    for name, shape in expected.items():
        found = tuple(weights[name].shape)
        if found != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {found}; expected {shape}")


def dummy_weights(
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
    *,
    norm_value: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Seeded random weights: norms `norm_value`, biases 0, MXFP4 bytes uniform with scale 2^-7,
    everything else N(0, 0.02)."""
    generator = torch.Generator(device=device).manual_seed(DUMMY_SEED)
    weights = {}
    for name, shape in expected.items():
        leaf = name.rsplit(".", 2)
        if "norm" in leaf[-2] and leaf[-1] == "weight":
            weights[name] = torch.full(shape, norm_value, dtype=dtype, device=device)
        elif name.endswith("_blocks"):  # packed MXFP4 codes: uniform random bytes
            weights[name] = torch.randint(
                0, 256, shape, dtype=torch.uint8, device=device, generator=generator
            )
        elif name.endswith("_scales"):  # MXFP4 exponents: values of magnitude ~DUMMY_STD
            weights[name] = torch.full(shape, DUMMY_MXFP4_SCALE, dtype=torch.uint8, device=device)
        elif name.endswith("bias"):
            weights[name] = torch.zeros(shape, dtype=dtype, device=device)
        else:
            weights[name] = torch.empty(shape, dtype=dtype, device=device).normal_(
                0, DUMMY_STD, generator=generator
            )
    return weights


def read_generation_config(path: Path) -> dict[str, Any]:
    gen_path = path / "generation_config.json"
    if not gen_path.is_file():
        return {}
    try:
        return json.loads(gen_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{gen_path} is not valid JSON ({exc})") from exc


def eos_token_ids(generation_config: dict[str, Any], raw: dict[str, Any]) -> list[int]:
    """EOS ids from generation_config.json, else config.json; an int or a list in either."""
    value = generation_config.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]
