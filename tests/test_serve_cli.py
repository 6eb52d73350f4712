"""CLI contract: complete --help, localhost default, MLX gate before anything touches the model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
REPO_ROOT = Path(__file__).resolve().parents[1]


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
    assert f"--model {MISSING_MODEL}: no such folder or file" in stderr


# vLLM / SGLang spelling -> (our flag, a value, the namespace field it sets)
ALIASES = (
    ("--seed", "--random-seed", "7", "random_seed", 7),
    ("--gpu-memory-utilization", "--mem-fraction", "0.5", "mem_fraction", 0.5),
    ("--mem-fraction-static", "--mem-fraction", "0.25", "mem_fraction", 0.25),
    ("--max-num-batched-tokens", "--chunked-prefill-size", "256", "chunked_prefill_size", 256),
    ("--context-length", "--max-model-len", "128", "max_model_len", 128),
    ("--max-running-requests", "--max-num-seqs", "3", "max_num_seqs", 3),
    ("--model-path", "--model", "/some/folder", "model", "/some/folder"),
    ("--tokenizer-path", "--tokenizer", "/some/tok", "tokenizer", "/some/tok"),
    ("--uvicorn-log-level", "--log-level", "debug", "log_level", "debug"),
)  # fmt: skip


@pytest.mark.parametrize(("alias", "ours", "value", "field", "parsed"), ALIASES)
def test_vllm_and_sglang_aliases_set_the_same_field(alias, ours, value, field, parsed):
    parser = build_parser()
    assert getattr(parser.parse_args([alias, value]), field) == parsed
    assert getattr(parser.parse_args([ours, value]), field) == parsed
    # the same value under both spellings is no conflict
    assert getattr(parser.parse_args([alias, value, ours, value]), field) == parsed


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), True),
        (("--enable-prefix-caching",), True),
        (("--disable-prefix-caching",), False),
        (("--no-enable-prefix-caching",), False),
        (("--disable-radix-cache",), False),
        (("--disable-prefix-caching", "--no-enable-prefix-caching"), False),
    ],
)
def test_prefix_caching_spellings(flags, expected):
    args = build_parser().parse_args(list(flags))
    assert args.enable_prefix_caching is expected
    from torch_runner.serve.cli import engine_config

    assert engine_config(args).enable_prefix_caching is expected


def test_disable_cuda_graph_is_enforce_eager():
    assert build_parser().parse_args(["--disable-cuda-graph"]).enforce_eager is True
    assert build_parser().parse_args([]).enforce_eager is False


def test_help_groups_flags_like_vllm(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    headings = [
        line[:-1] for line in text.splitlines() if line and line[0] != " " and line.endswith(":")
    ]
    want = ["model", "serving", "scheduling", "memory", "parallel", "MLX"]
    assert headings[1:7] == want, headings
    for alias in ("--seed", "--gpu-memory-utilization", "--enable-prefix-caching", "-tp", "--tp-size",
                  "--max-num-batched-tokens", "--tokenizer", "--revision", "--generation-config",
                  "--trust-remote-code"):  # fmt: skip
        assert alias in text, alias


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_RUNNER_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "torch_runner.serve", *args],
        cwd=REPO_ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (("--seed", "1", "--random-seed", "2"), ("--seed 1", "--random-seed 2")),
        (("--gpu-memory-utilization", "0.5", "--mem-fraction", "0.3"), ("--gpu-memory-utilization", "--mem-fraction")),
        (("--enable-prefix-caching", "--disable-prefix-caching"), ("--enable-prefix-caching", "--disable-prefix-caching")),
    ],
)  # fmt: skip
def test_conflicting_aliases_exit_2_in_one_line(flags, names):
    line = _one_error_line(_run_cli("--model", MISSING_MODEL, *flags))
    assert "conflicts" in line and all(name in line for name in names), line
    assert MISSING_MODEL not in line  # refused before the model is looked at


def test_trust_remote_code_is_refused_in_one_line():
    line = _one_error_line(_run_cli("--model", MISSING_MODEL, "--trust-remote-code"))
    assert "--trust-remote-code" in line and "remote" in line
    assert MISSING_MODEL not in line


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """A real-layout HF cache holding a tiny checkpoint as tiny-org/tiny-llama (main, v1)."""
    from hf_cache import add_to_cache
    from serve_fixtures import save_serve_checkpoint

    root = tmp_path_factory.mktemp("hub")
    checkpoint, _ = save_serve_checkpoint(root / "ckpt")
    add_to_cache(root / "hf", "tiny-org/tiny-llama", checkpoint, refs=("main", "v1"))
    (root / "bare").mkdir()
    (root / "bare" / "config.json").write_text((checkpoint / "config.json").read_text())
    return root


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--model", "other-org/not-cached"), "`hf download other-org/not-cached`"),
        (("--model", "tiny-org/tiny-llama", "--revision", "nope"), "revision 'nope' is not in the Hugging Face cache"),
        (("--model", "{root}/bare"), "has no *.safetensors weights"),
        (("--model", "{root}/ckpt", "--revision", "main"), "--revision applies only to Hub model IDs"),
        (("--revision", "main"), "--revision needs --model"),
        (("--model", "{root}/ckpt", "--generation-config", "{root}/nowhere"), "--generation-config"),
    ],
)  # fmt: skip
def test_bad_model_input_exits_2_in_one_line_before_loading(hub_home, flags, expected):
    flags = tuple(f.replace("{root}", str(hub_home)) for f in flags)
    env = {"HF_HOME": str(hub_home / "hf"), "HF_HUB_OFFLINE": "1"}
    line = _one_error_line(_run_cli("--device", "cpu", *flags, env=env))
    assert expected in line, line
    assert "could not start the engine" not in line  # refused before the engine loads


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


@pytest.mark.parametrize(("flag", "value"), [("--quantization", "int3"), ("--moe-weights", "fp4")])
def test_unknown_quantization_flags_exit_naming_value_and_choices(run_main, flag, value):
    code, stderr = run_main("--model", MISSING_MODEL, flag, value)
    assert code == 2
    assert value in stderr and flag in stderr
    assert MISSING_MODEL not in stderr
