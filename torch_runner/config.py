"""Engine configuration: one validated dataclass.

Every knob the engine reads lives here, so the CLI, the offline `Engine(...)` keywords and the
server all build the same object and get the same errors (each naming the field and the values
it accepts) before a weight is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

ALLOWED_DTYPES = ("auto", "float32", "bfloat16", "float16")
ALLOWED_WEIGHT_PACKING = ("auto", "off")
ALLOWED_MOE_WEIGHTS = ("packed", "dequantized")  # models.loader.MOE_WEIGHTS
ALLOWED_QUANTIZATION = ("auto", "none", "int8", "int4", "fp8")  # models.quantize.QUANTIZATIONS
ALLOWED_SWA_KV = ("auto", "windowed", "paged")
ALLOWED_CPU_COMPILE = ("off", "on")  # runner/cpu_compiled.py
ALLOWED_EAGER_WARMUP = ("auto", "off")  # runner/warmup.py


def _require_int(name: str, value: object, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " or None" if allow_none else ""
        raise ValueError(f"{name}={value!r} is invalid; expected an integer >= {minimum}{extra}")


@dataclass
class EngineConfig:
    """Everything the engine needs to start.

    `max_total_tokens` fixes the paged KV pool size; when None the pool takes
    `mem_fraction` of the device's free memory (capped at what `max_num_seqs` requests of
    `max_model_len` tokens could ever use). `chunked_prefill_size` is the per-step token
    budget; 0 disables chunking (prompts are prefilled whole).
    """

    model: str | None = None  # a folder, a .gguf file or a Hub model ID (models/hub.py)
    tokenizer: str | None = None  # default: the model folder
    revision: str | None = None  # Hub branch, tag or commit of a Hub model ID
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_total_tokens: int | None = None
    mem_fraction: float = 0.3
    chunked_prefill_size: int = 512
    block_size: int = 16
    enable_prefix_caching: bool = True
    random_seed: int = 0
    enable_deterministic_inference: bool = False
    load_format: str = "safetensors"
    max_waiting: int = 1024
    max_cached_windows: int = 64  # SWA prefix payloads kept: this many windows of tokens (LRU)
    weight_packing: str = "auto"  # auto: oneDNN-packed matmul weights on CPU; off: dense
    cpu_compile: str = "off"  # on: batch-1 CPU decode through an inductor-compiled step
    # auto: on CUDA, run every eager prefill / lm_head shape once at start-up (runner/warmup.py)
    eager_warmup: str = "auto"
    moe_weights: str = "packed"  # MXFP4 experts as on disk; "dequantized": expanded at load
    quantization: str = "auto"  # auto: the checkpoint's (GGUF Q4 -> int4, Q8_0 -> int8), else none
    enforce_eager: bool = False  # True: never capture CUDA graphs for decode
    cuda_graph_max_bs: int = 64  # decode batches above this size run eagerly
    # with eager_warmup auto: decode graphs captured at start-up for contexts up to this many
    # tokens (capped at max_model_len); longer ones are captured on first use; 0: all lazily
    cuda_graph_warmup_keys: int = 4096
    # sliding-window KV: "windowed" per-request buffers (least memory), "paged" in the pool with
    # the full layers (CUDA graphs need it), "auto" = paged on CUDA, windowed elsewhere
    swa_kv: str = "auto"
    # ranks of one tensor-parallel group (torch_runner/distributed; docs/engine.md), and how long
    # a collective may wait for a rank before the step fails (a dead or hung rank)
    tensor_parallel_size: int = 1
    dist_timeout: int = 120
    # overlapped scheduling (engine_step.py): step N+1 is launched while step N runs and the host
    # reads step N back meanwhile. None = auto: on for CUDA, off on CPU / MPS and tensor parallel
    async_scheduling: bool | None = None
    # MoE under tensor parallel: whole experts per rank (E/N each) instead of 1/N of every expert
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer"):  # pathlib.Path is as good as a string
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model={self.model!r} is invalid; expected a path string or None")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ValueError(
                f"tokenizer={self.tokenizer!r} is invalid; expected a path string or None"
            )
        if self.revision is not None and not isinstance(self.revision, str):
            raise ValueError(f"revision={self.revision!r} is invalid; expected a string or None")
        if not isinstance(self.device, str):
            raise ValueError(f"device={self.device!r} is invalid; expected a string")
        if self.dtype not in ALLOWED_DTYPES:
            raise ValueError(
                f"dtype={self.dtype!r} is invalid; allowed values: {', '.join(ALLOWED_DTYPES)}"
            )
        _require_int("max_model_len", self.max_model_len, 1, allow_none=True)
        _require_int("max_num_seqs", self.max_num_seqs, 1)
        _require_int("max_total_tokens", self.max_total_tokens, 1, allow_none=True)
        _require_int("chunked_prefill_size", self.chunked_prefill_size, 0)
        _require_int("block_size", self.block_size, 1)
        _require_int("random_seed", self.random_seed, 0)
        _require_int("max_waiting", self.max_waiting, 1)
        _require_int("max_cached_windows", self.max_cached_windows, 0)
        _require_int("cuda_graph_max_bs", self.cuda_graph_max_bs, 1)
        _require_int("cuda_graph_warmup_keys", self.cuda_graph_warmup_keys, 0)
        _require_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _require_int("dist_timeout", self.dist_timeout, 1)
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(
                f"enable_expert_parallel={self.enable_expert_parallel!r} is invalid; "
                "allowed values: True, False"
            )
        if self.tensor_parallel_size > 1 and self.swa_kv == "windowed":
            raise ValueError(
                f"swa_kv='windowed' is invalid with tensor_parallel_size="
                f"{self.tensor_parallel_size}; allowed values: auto, paged (the workers keep "
                "sliding-window KV in the paged pool)"
            )
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling={self.async_scheduling!r} is invalid; expected true, false "
                "or None (auto)"
            )
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(
                f"async_scheduling=True is invalid with tensor_parallel_size="
                f"{self.tensor_parallel_size}; allowed values: false, None (the workers take "
                "each step's token ids from rank 0's host, so steps cannot be chained)"
            )
        if self.weight_packing not in ALLOWED_WEIGHT_PACKING:
            raise ValueError(
                f"weight_packing={self.weight_packing!r} is invalid; allowed values: "
                f"{', '.join(ALLOWED_WEIGHT_PACKING)}"
            )
        if self.cpu_compile not in ALLOWED_CPU_COMPILE:
            raise ValueError(
                f"cpu_compile={self.cpu_compile!r} is invalid; allowed values: "
                f"{', '.join(ALLOWED_CPU_COMPILE)}"
            )
        if self.eager_warmup not in ALLOWED_EAGER_WARMUP:
            raise ValueError(
                f"eager_warmup={self.eager_warmup!r} is invalid; allowed values: "
                f"{', '.join(ALLOWED_EAGER_WARMUP)}"
            )
        if self.moe_weights not in ALLOWED_MOE_WEIGHTS:
            raise ValueError(
                f"moe_weights={self.moe_weights!r} is invalid; allowed values: "
                f"{', '.join(ALLOWED_MOE_WEIGHTS)}"
            )
        if self.quantization not in ALLOWED_QUANTIZATION:
            raise ValueError(
                f"quantization={self.quantization!r} is invalid; allowed values: "
                f"{', '.join(ALLOWED_QUANTIZATION)}"
            )
        if self.swa_kv not in ALLOWED_SWA_KV:
            raise ValueError(
                f"swa_kv={self.swa_kv!r} is invalid; allowed values: {', '.join(ALLOWED_SWA_KV)}"
            )
        if isinstance(self.mem_fraction, bool) or not isinstance(self.mem_fraction, int | float):
            raise ValueError(
                f"mem_fraction={self.mem_fraction!r} is invalid; expected a number in (0, 1]"
            )
        if not 0.0 < float(self.mem_fraction) <= 1.0:
            raise ValueError(
                f"mem_fraction={self.mem_fraction!r} is invalid; expected a number in (0, 1]"
            )
        for name in ("enable_prefix_caching", "enable_deterministic_inference", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is invalid; expected true or false"
                )
        if self.chunked_prefill_size and self.chunked_prefill_size < self.block_size:
            raise ValueError(
                f"chunked_prefill_size={self.chunked_prefill_size} is invalid; expected 0 (off) or "
                f">= block_size ({self.block_size})"
            )

    @property
    def is_chunked_prefill(self) -> bool:
        return self.chunked_prefill_size > 0

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
