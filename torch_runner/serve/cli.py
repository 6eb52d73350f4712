"""`python -m torch_runner.serve`: parse flags, gate MLX, start the engine, print one banner, serve.

Order matters: the MLX runtime gate (`use_mlx()`, then `validate_device(resolve_device(...))`)
runs before the model path is resolved or a weight is read, so a broken MLX install or an
MLX-incompatible device fails in one line, in a second, not after loading a checkpoint.
Every start-up error exits with status 2 and a message naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from bridge import MlxRuntimeError, resolve_device, use_mlx, validate_device
from models.loader import LOAD_FORMATS
from torch_runner.config import ALLOWED_DTYPES
from torch_runner.serve.drain import DEFAULT_SHUTDOWN_TIMEOUT
from torch_runner.serve.state import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CHOICES

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

EPILOG = """\
environment:
  TORCH_RUNNER_USE_MLX=1     route the default MLX op set (attention, rms_norm, sampler) through MLX.
                             The MLX runtime and the device are validated before the model loads
                             (stable torch 2.13.x, MLX >= 0.32.0; devices cpu or mps; never cuda).
  TORCH_RUNNER_MLX_OPS=...   with TORCH_RUNNER_USE_MLX=1, choose the MLX ops: a comma list of op
                             names (e.g. attention,rms_norm), 'all', 'none' or 'auto' (the ops
                             measured faster through MLX on this platform). Ignored when MLX is off.
  TORCH_RUNNER_CACHE_DIR     where the embedded default model is converted to safetensors.

examples:
  python -m torch_runner.serve                                   # embedded SmolLM2-135M-Instruct
  python -m torch_runner.serve --model ./Qwen3-0.6B --dtype bfloat16 --port 9000 --api-key s3cret
  TORCH_RUNNER_USE_MLX=1 TORCH_RUNNER_MLX_OPS=attention python -m torch_runner.serve --device cpu
"""


def _config_defaults() -> dict[str, Any]:
    from torch_runner.config import EngineConfig

    return {f: getattr(EngineConfig, f, None) for f in EngineConfig.field_names()}


def build_parser() -> argparse.ArgumentParser:
    """Every flag, with defaults taken from EngineConfig so the CLI and the engine never drift."""
    d = _config_defaults()
    parser = argparse.ArgumentParser(
        prog="python -m torch_runner.serve",
        description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /metrics) over torch_runner's engine.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        help="Hugging Face model folder (config.json + safetensors). Default: the embedded SmolLM2-135M-Instruct.",
    )
    model.add_argument(
        "--served-model-name",
        default=None,
        help="Name clients pass as `model` (default: the model folder's name). 'default' is always accepted too.",
    )
    model.add_argument(
        "--device",
        default=d["device"],
        help="auto (mps > cuda > cpu), mps, cuda, cuda:N or cpu. Default: %(default)s.",
    )
    model.add_argument(
        "--dtype",
        default=d["dtype"],
        choices=ALLOWED_DTYPES,
        help="Weights and activations dtype (auto: the checkpoint's). Default: %(default)s.",
    )
    model.add_argument(
        "--load-format",
        default=d["load_format"],
        choices=LOAD_FORMATS,
        help="safetensors, or dummy (seeded random weights from config.json alone). "
        "Default: %(default)s.",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--max-model-len",
        type=int,
        default=d["max_model_len"],
        help="Context length (prompt + completion). Default: the model's.",
    )
    engine.add_argument(
        "--max-num-seqs",
        type=int,
        default=d["max_num_seqs"],
        help="Most requests decoded together. Default: %(default)s.",
    )
    engine.add_argument(
        "--max-waiting",
        type=int,
        default=d["max_waiting"],
        help="Bounded waiting queue; beyond it requests get 503 + Retry-After. Default: %(default)s.",
    )
    engine.add_argument(
        "--max-total-tokens",
        type=int,
        default=d["max_total_tokens"],
        help="KV pool size in tokens (overrides --mem-fraction).",
    )
    engine.add_argument(
        "--mem-fraction",
        type=float,
        default=d["mem_fraction"],
        help="Fraction of free device memory for the KV pool when --max-total-tokens is unset. Default: %(default)s.",
    )
    engine.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=d["chunked_prefill_size"],
        help="Per-step prefill token budget; 0 disables chunking. Default: %(default)s.",
    )
    engine.add_argument(
        "--disable-prefix-caching",
        action="store_true",
        help="Turn the radix prefix cache off (finished requests then keep no KV blocks).",
    )
    engine.add_argument(
        "--random-seed",
        type=int,
        default=d["random_seed"],
        help="Seed of the engine's generator (unseeded requests). Default: %(default)s.",
    )
    engine.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="Seed every row (the request's seed, or 42) so outputs never depend on batchmates.",
    )
    engine.add_argument(
        "--weight-packing",
        choices=("auto", "off"),
        default=d["weight_packing"],
        help="auto: on CPU, pack the matmul weights for oneDNN once at start-up (fp32 on AVX2; "
        "bf16/fp16 where the CPU supports it): 1.3-2.7x faster decode matmuls, same memory "
        "except one packed copy of a tied embedding; off: plain torch linear. "
        "Default: %(default)s.",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Never capture CUDA graphs for decode (CUDA only; other devices always run eagerly).",
    )
    engine.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=d["cuda_graph_max_bs"],
        help="Largest decode batch replayed from a CUDA graph; larger ones run eagerly. "
        "Default: %(default)s.",
    )
    _add_tool_flags(parser)
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="Bind address. Default: %(default)s (local only; use 0.0.0.0 to expose).",
    )
    server.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="Port. Default: %(default)s."
    )
    server.add_argument(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer <key>' on /v1/* (401 otherwise).",
    )
    server.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="Request body size limit (413 above it). Default: %(default)s.",
    )
    server.add_argument(
        "--max-choices-per-request",
        type=int,
        default=DEFAULT_MAX_CHOICES,
        help="Most choices (prompts x n) one request may ask for; more is a 400. "
        "Default: %(default)s.",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="On SIGTERM/SIGINT: seconds in-flight requests may run on (new ones get 503) "
        "before the rest are ended with an error. Default: %(default)s.",
    )
    server.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS, help="Default: %(default)s."
    )
    return parser


def _add_tool_flags(parser: argparse.ArgumentParser) -> None:
    from torch_runner.serve.tool_parsers import tool_parser_names

    tools = parser.add_argument_group("chat template and tool calling (docs/serving.md#tools)")
    tools.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="A Jinja chat template file replacing the model's (tools reach it as `tools`).",
    )
    tools.add_argument(
        "--tool-call-parser",
        default=None,
        choices=tool_parser_names(),
        help="How tool calls are read from tool_choice=auto output (vLLM's names). Default: "
        "from the model (chat template markers, then model_type); hermes for a template "
        "without tools.",
    )
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="Accepted for vLLM compatibility; tool_choice=auto is always on.",
    )
    _add_reasoning_flag(tools)


def _add_reasoning_flag(group: argparse._ArgumentGroup) -> None:
    from torch_runner.serve.chat_format import REASONING_PARSER_CHOICES

    group.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=REASONING_PARSER_CHOICES,
        help="How reasoning is split from the answer into reasoning_content (vLLM's names; "
        "docs/serving.md#reasoning). auto: openai_gptoss (harmony) for gpt-oss, qwen3 for a "
        "chat template that writes </think>, else none. Default: %(default)s.",
    )


def engine_config(args: argparse.Namespace):
    from torch_runner.config import EngineConfig

    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_total_tokens=args.max_total_tokens,
        mem_fraction=args.mem_fraction,
        chunked_prefill_size=args.chunked_prefill_size,
        random_seed=args.random_seed,
        enable_prefix_caching=not args.disable_prefix_caching,
        enable_deterministic_inference=args.enable_deterministic_inference,
        load_format=args.load_format,
        max_waiting=args.max_waiting,
        weight_packing=args.weight_packing,
        enforce_eager=args.enforce_eager,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
    )


def gate_mlx(device_spec: str) -> None:
    """The MLX gate, first thing: validate the runtime, then that MLX can use the device."""
    if use_mlx():
        validate_device(resolve_device(device_spec))


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m torch_runner.serve`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        gate_mlx(args.device)
    except (MlxRuntimeError, ValueError) as exc:
        _fail(str(exc))
    if not 0 <= args.port <= 65535:
        _fail(f"--port {args.port} is out of range; allowed: 0..65535")
    if args.max_body_bytes < 1:
        _fail(f"--max-body-bytes {args.max_body_bytes} is invalid; expected >= 1")
    if args.max_choices_per_request < 1:
        _fail(f"--max-choices-per-request {args.max_choices_per_request} is invalid; expected >= 1")
    if not args.shutdown_timeout >= 0:
        _fail(f"--shutdown-timeout {args.shutdown_timeout} is invalid; expected seconds >= 0")
    try:
        config = engine_config(args)
    except ValueError as exc:
        _fail(f"invalid engine flag: {exc}")

    from torch_runner.serve.server import run_server

    run_server(args, config)
