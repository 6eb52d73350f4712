"""`python -m torch_runner.serve`: parse flags, gate MLX, start the engine, print one banner, serve.

Order matters: the MLX runtime gate (`use_mlx()`, then `validate_device(resolve_device(...))`)
runs before the model path is resolved or a weight is read, so a broken MLX install or an
MLX-incompatible device fails in one line, in a second, not after loading a checkpoint. Then
`resolve_model_files` turns a Hub ID into its cached snapshot (models/hub.py), checks a local
folder, and reads the --generation-config defaults, all before a weight is read.
Every start-up error exits with status 2 and one line naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from bridge import MlxRuntimeError, resolve_device, use_mlx, validate_device
from torch_runner.serve.flags import DTYPE_ALIASES, FlagConflict, build_parser

__all__ = ["build_parser", "engine_config", "gate_mlx", "main"]

TRUST_REMOTE_CODE_REFUSAL = (
    "--trust-remote-code is not supported: torch_runner never runs code from a model repository "
    "(every supported family is built in); remove the flag"
)


def engine_config(args: argparse.Namespace):
    from torch_runner.config import EngineConfig

    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        device=args.device,
        dtype=DTYPE_ALIASES.get(args.dtype, args.dtype),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_total_tokens=args.max_total_tokens,
        mem_fraction=args.mem_fraction,
        chunked_prefill_size=args.chunked_prefill_size,
        random_seed=args.random_seed,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_deterministic_inference=args.enable_deterministic_inference,
        load_format=args.load_format,
        max_waiting=args.max_waiting,
        weight_packing=args.weight_packing,
        cpu_compile=args.cpu_compile,
        eager_warmup=args.eager_warmup,
        moe_weights=args.moe_weights,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        cuda_graph_warmup_keys=args.cuda_graph_warmup_keys,
        async_scheduling=args.async_scheduling,
        swa_kv=args.swa_kv,
        tensor_parallel_size=args.tensor_parallel_size,
        dist_timeout=args.dist_timeout,
        enable_expert_parallel=args.enable_expert_parallel,
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
    try:
        args = build_parser().parse_args(argv)
    except FlagConflict as exc:
        _fail(str(exc))
    if args.trust_remote_code:
        _fail(TRUST_REMOTE_CODE_REFUSAL)
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
    try:
        config, defaults = resolve_model_files(args, config)
    except ValueError as exc:  # ModelLoadError included: one line, before anything loads
        _fail(str(exc))

    from torch_runner.serve.server import run_server

    run_server(args, config, defaults)


def resolve_model_files(args: argparse.Namespace, config):
    """Hub IDs -> cached snapshot folders, local folders checked, sampling defaults read.

    Returns the config with local paths and the `SamplingDefaults` (None for the embedded
    default model: its folder is only known once it is converted, so the server reads them).
    """
    from models.hub import resolve_model, resolve_tokenizer
    from torch_runner import SamplingParams
    from torch_runner.serve.generation_defaults import load_sampling_defaults

    model, tokenizer = config.model, config.tokenizer
    if model is not None:
        model = str(resolve_model(model, revision=args.revision, load_format=config.load_format))
    elif args.revision is not None:
        raise ValueError("--revision needs --model (a Hub model ID)")
    if tokenizer is not None:
        tokenizer = str(resolve_tokenizer(tokenizer, revision=args.tokenizer_revision))
    elif args.tokenizer_revision is not None:
        raise ValueError("--tokenizer-revision needs --tokenizer (a Hub model ID)")
    defaults = None
    if model is not None or args.generation_config != "auto":
        defaults = load_sampling_defaults(args.generation_config, model, SamplingParams)
    return dataclasses.replace(config, model=model, tokenizer=tokenizer), defaults
