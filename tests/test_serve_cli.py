"""CLI contract: complete --help, localhost default, MLX gate before anything touches the model."""

from __future__ import annotations

import os

import pytest

from bridge.runtime import reset_cache
from torch_runner.serve.cli import build_parser, main

ISSUE_FLAGS = (
    "--model", "--host", "--port", "--device", "--dtype", "--max-model-len", "--max-num-seqs",
    "--max-total-tokens", "--mem-fraction", "--chunked-prefill-size", "--api-key",
    "--served-model-name", "--random-seed", "--enable-deterministic-inference", "--log-level",
    "--max-waiting", "--load-format", "--max-body-bytes",
)  # fmt: skip
MISSING_MODEL = "/nonexistent/model-folder-for-serve-tests"


def test_help_lists_every_flag_and_documents_mlx_toggles(capsys):
    # In-process (`python -m torch_runner.serve` itself runs in test_serve_openai's server).
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ISSUE_FLAGS:
        assert flag in text, flag
    for env_name in ("TORCH_RUNNER_USE_MLX", "TORCH_RUNNER_MLX_OPS"):
        assert env_name in text, env_name


def test_binds_localhost_by_default():
    args = build_parser().parse_args([])
    assert args.host == "127.0.0.1"
    assert args.model is None  # the embedded default model


def test_defaults_follow_engine_config():
    from torch_runner.config import EngineConfig

    args = build_parser().parse_args([])
    config = EngineConfig()
    for name in (
        "max_num_seqs",
        "chunked_prefill_size",
        "mem_fraction",
        "max_waiting",
        "random_seed",
    ):
        assert getattr(args, name) == getattr(config, name), name


@pytest.fixture
def run_main(monkeypatch, capsys):
    """Call the CLI in-process with a clean MLX gate; returns (exit code, stderr)."""

    def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
        for name in [k for k in os.environ if k.startswith("TORCH_RUNNER_")]:
            monkeypatch.delenv(name)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        reset_cache()
        try:
            with pytest.raises(SystemExit) as exit_info:
                main(list(args))
        finally:
            reset_cache()
        return exit_info.value.code, capsys.readouterr().err

    return run


def test_mlx_gate_rejects_bad_flag_before_model_is_resolved(run_main):
    code, stderr = run_main("--model", MISSING_MODEL, env={"TORCH_RUNNER_USE_MLX": "maybe"})
    assert code == 2
    assert "TORCH_RUNNER_USE_MLX" in stderr
    assert MISSING_MODEL not in stderr


def test_mlx_gate_rejects_unusable_device_before_model_is_resolved(run_main):
    # cuda is either absent here (resolve_device refuses) or present (MLX cannot borrow CUDA
    # memory): both are gate errors, and neither may mention the model.
    code, stderr = run_main(
        "--model", MISSING_MODEL, "--device", "cuda", env={"TORCH_RUNNER_USE_MLX": "1"}
    )
    assert code == 2
    assert "cuda" in stderr.lower()
    assert MISSING_MODEL not in stderr


def test_invalid_engine_flag_exits_naming_it(run_main):
    code, stderr = run_main("--model", MISSING_MODEL, "--max-num-seqs", "0")
    assert code == 2
    assert "max_num_seqs" in stderr
    assert MISSING_MODEL not in stderr


def test_mlx_gate_passes_on_cpu_then_the_model_is_resolved(run_main):
    # mlx[cpu] is installed here, so the gate accepts cpu and start-up proceeds to the model,
    # which is where this run fails (with a clean message, not a traceback).
    code, stderr = run_main(
        "--model", MISSING_MODEL, "--device", "cpu", env={"TORCH_RUNNER_USE_MLX": "1"}
    )
    assert code == 2
    assert "could not start the engine" in stderr and MISSING_MODEL in stderr


def test_reasoning_parser_flag_takes_vllm_names(run_main):
    args = build_parser().parse_args([])
    assert args.reasoning_parser == "auto"
    assert "--reasoning-parser" in build_parser().format_help()
    for name in ("qwen3", "deepseek_r1", "openai_gptoss", "none"):
        assert build_parser().parse_args(["--reasoning-parser", name]).reasoning_parser == name
    code, stderr = run_main("--reasoning-parser", "gptoss")
    assert code == 2 and "--reasoning-parser" in stderr and "openai_gptoss" in stderr


def test_harmony_parser_on_a_model_without_harmony_exits_naming_the_flag(run_main, llama, tmp_path):
    """The tiny Llama's byte tokenizer is no o200k_harmony: refused at start-up, in one line."""
    path, _ = llama
    code, stderr = run_main(
        "--model", path, "--device", "cpu", "--reasoning-parser", "openai_gptoss",
        env={"TORCH_RUNNER_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert code == 2
    assert "--reasoning-parser openai_gptoss" in stderr and "--reasoning-parser none" in stderr
