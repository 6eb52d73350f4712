"""Start the engine, print the one start-up banner, and run uvicorn until interrupted."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from typing import Any

from torch_runner.serve.generation_defaults import SamplingDefaults, load_sampling_defaults
from torch_runner.serve.state import DEFAULT_MAX_CHOICES, DEFAULT_MODEL_ALIAS, ServingState

FINAL_EVENT_SECONDS = 5  # uvicorn's own wait, after the drain, for responses still being sent


def served_name(args: argparse.Namespace, engine: Any) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model and not os.path.exists(os.path.expanduser(args.model)):
        return args.model  # a Hub ID is served under its own name, as vLLM does
    if args.model:
        return os.path.basename(os.path.normpath(args.model)) or args.model
    return getattr(engine, "model_name", None) or "SmolLM2-135M-Instruct"


def banner(
    state: ServingState, engine: Any, backends: dict[str, str], url: str, frozen: int
) -> str:
    """Device, dtype, per-op backend, KV capacity, tool parser, the frozen start-up heap and URL,
    in one block printed once."""
    stats = state.engine_stats()
    ops = ", ".join(f"{name}={backend}" for name, backend in backends.items())
    auth = " (API key required)" if state.api_key else ""
    return "\n".join(
        [
            f"torch_runner serve: model {state.model_name!r} (alias {DEFAULT_MODEL_ALIAS!r})",
            f"  device: {engine.device}   dtype: {str(engine.dtype).removeprefix('torch.')}",
            f"  ops: {ops}",
            f"  sampling defaults: {state.sampling_defaults.describe()}",
            f"  KV capacity: {stats.get('kv_total_tokens')} tokens   max_model_len: {state.max_model_len}   "
            f"max_num_seqs: {engine.config.max_num_seqs}",
            f"  tool-call parser: {state.tool_parser_name}"
            + ("   chat template: --chat-template" if state.chat_template else ""),
            f"  start-up heap: {frozen} objects frozen (gc.freeze)",
            f"  listening on {url}/v1{auth}",
        ]
    )


def read_chat_template(path: str | None) -> str | None:
    """--chat-template: a file holding a Jinja chat template."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise ValueError(f"--chat-template {path!r} cannot be read: {exc}") from None


def serving_state(
    engine: Any,
    async_engine: Any,
    *,
    model_name: str,
    api_key: str | None,
    max_body_bytes: int,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str = "auto",
    max_choices: int = DEFAULT_MAX_CHOICES,
    sampling_defaults: SamplingDefaults | None = None,
):
    """The state the app needs, from a loaded `Engine` and its started `AsyncEngine`.

    The tool-call parser is `tool_call_parser` when given, else picked from the model
    (model_type, then the chat template; see serve/output_parsers.py); the chat format
    (harmony, a reasoning parser) likewise from `reasoning_parser` (serve/chat_format.py); a
    ValueError names the flag that cannot work with this model. `sampling_defaults` None reads
    the model folder's generation_config.json (`--generation-config auto`).
    """
    from torch_runner import SamplingParams
    from torch_runner.serve.chat_format import select_chat_format
    from torch_runner.serve.output_parsers import default_tool_parser_name

    model_type = getattr(getattr(engine, "args", None), "model_type", None)
    template = chat_template or getattr(engine.tokenizer, "chat_template", None)
    parser = tool_call_parser or default_tool_parser_name(model_type, template)
    chat_format = select_chat_format(engine.tokenizer, model_type, reasoning_parser, template)
    if sampling_defaults is None:
        sampling_defaults = load_sampling_defaults("auto", engine.model_path, SamplingParams)
    return ServingState(
        engine=async_engine,
        tokenizer=engine.tokenizer,
        model_name=model_name,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        params_cls=SamplingParams,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        model_type=model_type,
        chat_template=chat_template,
        tool_parser_name=parser,
        chat_format=chat_format,
        max_choices=max_choices,
        sampling_defaults=sampling_defaults,
        eos_token_ids=frozenset(getattr(engine, "eos_token_ids", ())),
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket first, so a busy port fails in a second, before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is fine
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        print(
            f"error: cannot listen on {host}:{port} (--host/--port): {exc.strerror}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    sock.set_inheritable(True)
    return sock


def run_server(
    args: argparse.Namespace, config: Any, sampling_defaults: SamplingDefaults | None = None
) -> None:
    """Bind the port, load the engine (after the CLI's MLX gate), print the banner, serve until
    SIGTERM/SIGINT, then drain (serve/drain.py) and exit 0."""
    import uvicorn

    import ops
    from torch_runner import AsyncEngine, Engine, SamplingParams
    from torch_runner.distributed.group import torchrun_env
    from torch_runner.gc_heap import freeze_startup_heap
    from torch_runner.serve.app import create_app
    from torch_runner.serve.drain import DrainingServer
    from torch_runner.serve.self_warmup import warm_up_server

    if config.tensor_parallel_size > 1 and (torchrun_env() or (0,))[0] > 0:
        Engine.from_config(config)  # a torchrun rank > 0 serves steps in here, then exits
        return
    sock = bind_socket(args.host, args.port)
    try:
        chat_template = read_chat_template(args.chat_template)
        engine = Engine.from_config(config)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: could not start the engine: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if sampling_defaults is None:
        try:
            sampling_defaults = load_sampling_defaults("auto", engine.model_path, SamplingParams)
        except ValueError as exc:  # a generation_config.json value the sampler refuses
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    engine.warm_up_sampling(SamplingParams(**sampling_defaults.values))  # before the loop starts
    async_engine = AsyncEngine(engine)
    # a tensor-parallel rank that died or hung stops the engine loop (health answers 503); SIGTERM
    # then drains and stops the server, and the exit below says why
    async_engine.on_fatal = lambda exc: os.kill(os.getpid(), signal.SIGTERM)
    async_engine.start()
    try:
        try:
            state = serving_state(
                engine,
                async_engine,
                model_name=served_name(args, engine),
                api_key=args.api_key,
                max_body_bytes=args.max_body_bytes,
                chat_template=chat_template,
                tool_call_parser=args.tool_call_parser,
                max_choices=args.max_choices_per_request,
                reasoning_parser=args.reasoning_parser,
                sampling_defaults=sampling_defaults,
            )
        except ValueError as exc:  # a --reasoning-parser this model cannot use
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        app = create_app(state)
        if not args.skip_server_warmup:
            warm_up_server(app, state.model_name, args.api_key)
        url = f"http://{args.host}:{sock.getsockname()[1]}"
        frozen = freeze_startup_heap()  # after the warm-up: its garbage is collected first
        print(banner(state, engine, ops.backends(), url, frozen), flush=True)
        config = uvicorn.Config(
            app, log_level=args.log_level, timeout_graceful_shutdown=FINAL_EVENT_SECONDS
        )
        server = DrainingServer(config, state.drain, async_engine, args.shutdown_timeout)
        server.run(sockets=[sock])
        state.pool.close()
    finally:
        async_engine.shutdown()
        engine.close()
    if async_engine.fatal_error is not None:
        print(f"error: the engine stopped: {async_engine.fatal_error}", file=sys.stderr)
        raise SystemExit(1)
