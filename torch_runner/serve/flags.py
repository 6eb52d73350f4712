"""Every command-line flag, grouped the way vLLM's `--help` groups them.

One function per group (model, serving, scheduling, memory, MLX): adding a flag to a group is
one `add(...)` call in its function. vLLM and SGLang spellings are extra option strings of the
same flag (`add("--random-seed", "--seed", ...)`), so a pasted command works and `--help` shows
both names; giving two spellings of one setting with different values is a `FlagConflict`
(one line, exit 2) instead of argparse's silent last-one-wins. Defaults come from EngineConfig
so the CLI and the engine never drift. docs/serving.md has the vLLM / SGLang -> ours table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from models.loader import LOAD_FORMATS
from torch_runner.config import (
    ALLOWED_DTYPES,
    ALLOWED_MOE_WEIGHTS,
    ALLOWED_QUANTIZATION,
    ALLOWED_SWA_KV,
)
from torch_runner.serve.drain import DEFAULT_SHUTDOWN_TIMEOUT
from torch_runner.serve.flag_actions import Adder, FlagConflict, adder, flag_const
from torch_runner.serve.state import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CHOICES

__all__ = ["DTYPE_ALIASES", "FlagConflict", "build_parser"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

DESCRIPTION = (
    "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, "
    "/tokenize, /detokenize, /health, /metrics) over torch_runner's engine. Flags also accept "
    "their vLLM / SGLang names (shown after a comma)."
)

MLX_HELP = """\
MLX runs through environment variables, read before the model loads:
  TORCH_RUNNER_USE_MLX=1     route the default MLX op set (attention, rms_norm, sampler) through MLX.
                             The MLX runtime and the device are validated before the model loads
                             (stable torch 2.13.x, MLX >= 0.32.0; devices cpu or mps; never cuda).
  TORCH_RUNNER_MLX_OPS=...   with TORCH_RUNNER_USE_MLX=1, choose the MLX ops: a comma list of op
                             names (e.g. attention,rms_norm), 'all', 'none' or 'auto' (the ops
                             measured faster through MLX on this platform). Ignored when MLX is off."""

EPILOG = """\
environment:
  TORCH_RUNNER_CACHE_DIR     where the embedded default model is converted to safetensors.
  HF_HOME, HF_HUB_CACHE      the Hugging Face cache that Hub model IDs resolve through.
  HF_HUB_OFFLINE=1           never touch the network: a cached Hub model loads, an uncached one
                             fails in one line saying how to fetch it.

examples:
  python -m torch_runner.serve                                   # embedded SmolLM2-135M-Instruct
  python -m torch_runner.serve --model Qwen/Qwen3-0.6B --revision main --port 9000
  python -m torch_runner.serve --model ./Qwen3-0.6B --dtype bfloat16 --api-key s3cret
  TORCH_RUNNER_USE_MLX=1 TORCH_RUNNER_MLX_OPS=attention python -m torch_runner.serve --device cpu
  python -m torch_runner.serve --model ./Qwen3-0.6B --tensor-parallel-size 2   # 2 spawned ranks
  torchrun --nproc-per-node 2 -m torch_runner.serve --model ./Qwen3-0.6B -tp 2
"""


def model_flags(add: Adder, d: dict[str, Any]) -> None:
    add(
        "--model",
        "--model-path",
        default=None,
        help="A Hugging Face model folder (config.json + safetensors), a .gguf file, or a Hub "
        "model ID (org/name, resolved through the Hugging Face cache). "
        "Default: the embedded SmolLM2-135M-Instruct.",
    )
    add("--revision", default=None, help="Hub branch, tag or commit of a Hub --model ID.")
    add(
        "--tokenizer",
        "--tokenizer-path",
        default=d["tokenizer"],
        help="Tokenizer folder or Hub ID (default: the model's).",
    )
    add("--tokenizer-revision", default=None, help="Hub revision of a Hub --tokenizer ID.")
    add(
        "--served-model-name",
        default=None,
        help="Name clients pass as `model` (default: the --model value, or the folder's name). "
        "'default' is always accepted too.",
    )
    add(
        "--device",
        default=d["device"],
        help="auto (mps > cuda > cpu), mps, cuda, cuda:N or cpu. Default: %(default)s.",
    )
    add(
        "--dtype",
        default=d["dtype"],
        choices=(*ALLOWED_DTYPES, *DTYPE_ALIASES),
        help="auto, float32 (float), bfloat16, float16 (half). Default: %(default)s.",
    )
    add(
        "--load-format",
        default=d["load_format"],
        choices=LOAD_FORMATS,
        help="safetensors, or dummy (seeded random weights from config.json alone). "
        "Default: %(default)s.",
    )
    add(
        "--generation-config",
        default="auto",
        help="auto: the model's generation_config.json supplies the sampling defaults "
        "(temperature, top_p, top_k, min_p, repetition_penalty) a request leaves unset; vllm: "
        "neutral defaults; or a folder / file holding a generation_config.json. "
        "Default: %(default)s.",
    )
    add(
        "--weight-packing",
        choices=("auto", "off"),
        default=d["weight_packing"],
        help="auto: on CPU, pack the matmul weights for oneDNN once at start-up (fp32 on AVX2; "
        "bf16/fp16 where the CPU supports it): 1.3-2.7x faster decode matmuls, same memory "
        "except one packed copy of a tied embedding; off: plain torch linear. "
        "Default: %(default)s.",
    )
    add(
        "--quantization",
        "-q",
        choices=ALLOWED_QUANTIZATION,
        default=d["quantization"],
        help="Weight-only quantization of every dense linear and the lm_head at load: int8 per "
        "output channel, int4 per 32 input columns (torch's int8/int4 pack kernels); auto: what "
        "the checkpoint holds (a GGUF's Q4_0/Q4_1 -> int4, Q8_0 -> int8; an fp8 checkpoint's "
        "e4m3 weights; else none); fp8: e4m3 weights with per-channel scales and per-token "
        "activation scales through torch._scaled_mm (CUDA GPUs with fp8 matmuls only). "
        "Default: %(default)s.",
    )
    add(
        "--moe-weights",
        choices=ALLOWED_MOE_WEIGHTS,
        default=d["moe_weights"],
        help="packed: MXFP4 MoE experts (gpt-oss) stay as on disk and are computed from directly; "
        "dequantized: expanded to --dtype at load (3.8x the memory; the reference). "
        "Default: %(default)s.",
    )
    add(
        "--cpu-compile",
        choices=("off", "on"),
        default=d["cpu_compile"],
        help="on: batch-1 CPU decode runs an inductor-compiled step (torch.compile, needs a C++ "
        "compiler; compiled at the first decode step, tens of seconds) for plain full-attention "
        "models with int8/int4 or unpacked (--weight-packing off) weights; others keep the "
        "eager loop. Default: %(default)s.",
    )
    add(
        "--eager-warmup",
        choices=("auto", "off"),
        default=d["eager_warmup"],
        help="auto: on CUDA, run each eager prefill and lm_head matmul shape once at start-up "
        "(under a second for a 1B model), so no request's first token pays cuBLAS's first-use "
        "choice; off: skip it. Default: %(default)s.",
    )
    add(
        "--enforce-eager",
        "--disable-cuda-graph",
        action="store_true",
        help="Never capture CUDA graphs for decode (CUDA only; other devices always run eagerly).",
    )
    add(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Overlapped scheduling: launch the next decode step while the current one runs "
        "and postprocess meanwhile (docs/engine.md). Default: on for CUDA, off elsewhere and "
        "under tensor parallel.",
    )
    add(
        "--cuda-graph-max-bs",
        type=int,
        default=d["cuda_graph_max_bs"],
        help="Largest decode batch replayed from a CUDA graph; larger ones run eagerly. "
        "Default: %(default)s.",
    )
    add(
        "--cuda-graph-warmup-keys",
        type=int,
        default=d["cuda_graph_warmup_keys"],
        help="With --eager-warmup auto: capture the decode graphs of every batch size for "
        "contexts up to this many tokens at start-up (capped at --max-model-len), so serving "
        "never stalls on a capture; longer contexts capture on first use; 0: all on first use. "
        "Default: %(default)s.",
    )
    add(
        "--trust-remote-code",
        action="store_true",
        help="Refused: no code from a model repository ever runs; every supported family is "
        "built in.",
    )


def serving_flags(add: Adder, d: dict[str, Any]) -> None:
    add(
        "--host",
        default=DEFAULT_HOST,
        help="Bind address. Default: %(default)s (local only; use 0.0.0.0 to expose).",
    )
    add("--port", type=int, default=DEFAULT_PORT, help="Port. Default: %(default)s.")
    add(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer <key>' on /v1/*, /tokenize and /detokenize "
        "(401 otherwise).",
    )
    add(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="Request body size limit (413 above it). Default: %(default)s.",
    )
    add(
        "--max-choices-per-request",
        type=int,
        default=DEFAULT_MAX_CHOICES,
        help="Most choices (prompts x n) one request may ask for; more is a 400. "
        "Default: %(default)s.",
    )
    add(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="On SIGTERM/SIGINT: seconds in-flight requests may run on (new ones get 503) "
        "before the rest are ended with an error. Default: %(default)s.",
    )
    add(
        "--skip-server-warmup",
        action="store_true",
        help="Do not send the start-up warm-up request (one greedy 2-token request per "
        "route, in process, before the port accepts; it takes the first-use costs out of "
        "the first client's latency).",
    )
    add(
        "--log-level",
        "--uvicorn-log-level",
        default="info",
        choices=LOG_LEVELS,
        help="Default: %(default)s.",
    )
    _tool_flags(add)


def _tool_flags(add: Adder) -> None:
    """Chat template and tool calling (docs/serving.md#tools); vLLM lists these as serving flags."""
    from torch_runner.serve.tool_parsers import tool_parser_names

    add(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="A Jinja chat template file replacing the model's (tools reach it as `tools`).",
    )
    add(
        "--tool-call-parser",
        default=None,
        choices=tool_parser_names(),
        help="How tool calls are read from tool_choice=auto output (vLLM's names). Default: "
        "from the model (model_type, chat template); hermes for a template without tools.",
    )
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        help="Accepted for vLLM compatibility; tool_choice=auto is always on.",
    )
    from torch_runner.serve.chat_format import REASONING_PARSER_CHOICES

    add(
        "--reasoning-parser",
        default="auto",
        choices=REASONING_PARSER_CHOICES,
        help="How reasoning is split from the answer into reasoning_content (vLLM's names; "
        "docs/serving.md#reasoning). auto: openai_gptoss (harmony) for gpt-oss, qwen3 for a "
        "chat template that writes </think>, else none. Default: %(default)s.",
    )


def scheduling_flags(add: Adder, d: dict[str, Any]) -> None:
    add(
        "--max-model-len",
        "--context-length",
        type=int,
        default=d["max_model_len"],
        help="Context length (prompt + completion). Default: the model's.",
    )
    add(
        "--max-num-seqs",
        "--max-running-requests",
        type=int,
        default=d["max_num_seqs"],
        help="Most requests decoded together. Default: %(default)s.",
    )
    add(
        "--max-waiting",
        type=int,
        default=d["max_waiting"],
        help="Bounded waiting queue; beyond it requests get 503 + Retry-After. Default: %(default)s.",
    )
    add(
        "--chunked-prefill-size",
        "--max-num-batched-tokens",
        type=int,
        default=d["chunked_prefill_size"],
        help="Per-step prefill token budget; 0 disables chunking. Default: %(default)s.",
    )
    flag_const(
        add,
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        const=True,
        help="Keep the radix prefix cache on (the default).",
    )
    flag_const(
        add,
        "--disable-prefix-caching",
        "--no-enable-prefix-caching",
        "--disable-radix-cache",
        dest="enable_prefix_caching",
        const=False,
        help="Turn the radix prefix cache off (finished requests then keep no KV blocks).",
    )
    add(
        "--random-seed",
        "--seed",
        type=int,
        default=d["random_seed"],
        help="Seed of the engine's generator (unseeded requests). Default: %(default)s.",
    )
    add(
        "--enable-deterministic-inference",
        action="store_true",
        help="Seed every row (the request's seed, or 42) so outputs never depend on batchmates.",
    )


def memory_flags(add: Adder, d: dict[str, Any]) -> None:
    add(
        "--mem-fraction",
        "--gpu-memory-utilization",
        "--mem-fraction-static",
        type=float,
        default=d["mem_fraction"],
        help="Fraction of free device memory for the KV pool when --max-total-tokens is unset. "
        "Default: %(default)s.",
    )
    add(
        "--max-total-tokens",
        type=int,
        default=d["max_total_tokens"],
        help="KV pool size in tokens (overrides --mem-fraction).",
    )
    add(
        "--swa-kv",
        choices=ALLOWED_SWA_KV,
        default=d["swa_kv"],
        help="Sliding-window KV: windowed per-request buffers (least memory), paged in the pool "
        "(CUDA graphs need it), auto = paged on CUDA. Default: %(default)s.",
    )


def parallel_flags(add: Adder, d: dict[str, Any]) -> None:
    add(
        "--tensor-parallel-size",
        "-tp",
        "--tp-size",
        "--tp",
        type=int,
        default=d["tensor_parallel_size"],
        help="Ranks of one tensor-parallel group (gloo on CPU, NCCL on CUDA): spawned on this "
        "host, or every rank started by torchrun (docs/engine.md). Default: %(default)s.",
    )
    add(
        "--dist-timeout",
        type=int,
        default=d["dist_timeout"],
        help="Seconds a collective waits for a rank before the server fails health and exits "
        "(a dead or hung rank). Default: %(default)s.",
    )
    add(
        "--enable-expert-parallel",
        action="store_true",
        default=d["enable_expert_parallel"],
        help="With --tensor-parallel-size N: place whole MoE experts on the ranks (E/N each; "
        "qwen3_moe, gpt-oss) instead of splitting every expert's intermediate dimension.",
    )


def mlx_flags(add: Adder, d: dict[str, Any]) -> None:
    """No flags yet: MLX is switched by the environment (see the group's description)."""


# (title, description, function): --help shows the groups in this order.
GROUPS: tuple[tuple[str, str | None, Callable[[Adder, dict[str, Any]], None]], ...] = (
    ("model", None, model_flags),
    ("serving", None, serving_flags),
    ("scheduling", None, scheduling_flags),
    ("memory", None, memory_flags),
    ("parallel", None, parallel_flags),
    ("MLX", MLX_HELP, mlx_flags),
)


def _config_defaults() -> dict[str, Any]:
    from torch_runner.config import EngineConfig

    return {f: getattr(EngineConfig, f, None) for f in EngineConfig.field_names()}


def build_parser() -> argparse.ArgumentParser:
    """Every flag, in vLLM's groups, with defaults taken from EngineConfig."""
    defaults = _config_defaults()
    parser = argparse.ArgumentParser(
        prog="python -m torch_runner.serve",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(enable_prefix_caching=defaults["enable_prefix_caching"])
    for title, description, add_flags in GROUPS:
        add_flags(adder(parser.add_argument_group(title, description)), defaults)
    return parser
