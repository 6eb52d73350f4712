"""models/hub.py: `--model` as a folder, a .gguf file or a Hub ID resolved through a real-layout cache.

The cache is built by tests/hf_cache.py under a tmp HF_HOME; `huggingface_hub` itself reads it
(scan_cache_dir and snapshot_download), so a layout it would not accept fails these tests. No
network: HF_HUB_OFFLINE, or an endpoint on a closed local port (the "no network" case).
"""

from __future__ import annotations

import socket

import pytest
from hf_cache import COMMIT, add_to_cache
from serve_fixtures import save_serve_checkpoint

from models.errors import ModelLoadError
from models.hub import is_hub_id, resolve_model, resolve_tokenizer

REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = save_serve_checkpoint(tmp_path_factory.mktemp("ckpt"))
    return path


@pytest.fixture
def hub(tmp_path, monkeypatch, checkpoint):
    """A cache holding REPO at COMMIT (refs main and v1), read offline."""
    from huggingface_hub import constants

    hf_home = tmp_path / "hf"
    snapshot = add_to_cache(hf_home, REPO, checkpoint, refs=("main", "v1"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home, snapshot


def test_cache_layout_is_the_one_huggingface_hub_reads(hub):
    from huggingface_hub import scan_cache_dir

    hf_home, snapshot = hub
    info = scan_cache_dir(hf_home / "hub")
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT and revision.refs == {"main", "v1"}
    assert {f.file_name for f in revision.files} >= {"config.json", "model.safetensors"}


@pytest.mark.parametrize("revision", [None, "main", "v1", COMMIT])
def test_hub_id_resolves_to_the_cached_snapshot(hub, revision):
    _, snapshot = hub
    assert resolve_model(REPO, revision=revision) == snapshot.resolve()


def test_tokenizer_hub_id_resolves(hub):
    _, snapshot = hub
    assert resolve_tokenizer(REPO) == snapshot.resolve()


def test_no_network_falls_back_to_the_cache(hub, monkeypatch):
    from huggingface_hub import constants

    with socket.socket() as sock:  # a port nobody listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    _, snapshot = hub
    assert resolve_model(REPO) == snapshot.resolve()
    with pytest.raises(ModelLoadError, match="the Hub cannot be reached; fetch it with"):
        resolve_model("tiny-org/absent")


def test_uncached_hub_id_says_how_to_fetch_it(hub):
    with pytest.raises(ModelLoadError) as info:
        resolve_model("other-org/not-cached")
    message = str(info.value)
    assert "\n" not in message
    assert "other-org/not-cached is not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE=1" in message and "`hf download other-org/not-cached`" in message


def test_unknown_revision_names_the_cached_ones(hub):
    with pytest.raises(ModelLoadError) as info:
        resolve_model(REPO, revision="no-such-branch")
    message = str(info.value)
    assert "\n" not in message
    assert "revision 'no-such-branch' is not in the Hugging Face cache" in message
    assert "main" in message and "v1" in message
    assert "--revision no-such-branch" in message


def test_cached_snapshot_without_weights_is_refused(tmp_path, monkeypatch, checkpoint):
    from huggingface_hub import constants

    add_to_cache(tmp_path, "tiny-org/no-weights", checkpoint, skip=("model.safetensors",))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="tiny-org/no-weights: .* has no \\*.safetensors"):
        resolve_model("tiny-org/no-weights")
    # a tokenizer needs no weights
    assert resolve_tokenizer("tiny-org/no-weights").is_dir()


def test_local_folder_is_checked_not_copied(checkpoint, tmp_path):
    assert resolve_model(checkpoint) == checkpoint
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model(empty)
    (empty / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="has no \\*.safetensors weights"):
        resolve_model(empty)
    assert resolve_model(empty, load_format="dummy") == empty  # dummy weights need none
    with pytest.raises(ModelLoadError, match="--revision applies only to Hub model IDs"):
        resolve_model(checkpoint, revision="main")


def test_tokenizer_folder_needs_no_config_but_a_tokenizer(checkpoint, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    with pytest.raises(ModelLoadError, match="holds no tokenizer"):
        resolve_tokenizer(folder)
    (folder / "tokenizer.json").write_text((checkpoint / "tokenizer.json").read_text())
    assert resolve_tokenizer(folder) == folder


def test_gguf_file_passes_through(tmp_path):
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(gguf) == gguf
    (tmp_path / "config.json").write_text("{}")
    folder_hint = tmp_path / "only-gguf"
    folder_hint.mkdir()
    (folder_hint / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model(folder_hint) == folder_hint / "m.gguf"  # a folder holding one GGUF
    (folder_hint / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="pass the file \\(m.gguf\\)"):
        resolve_model(folder_hint)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen/Qwen3-0.6B", True),
        ("gpt2", True),
        ("./Qwen3-0.6B", False),
        ("/abs/path/model", False),
        ("a/b/c", False),
        ("model.gguf", False),
        ("bad name with spaces", False),
    ],
)
def test_hub_id_shape(name, expected):
    assert is_hub_id(name) is expected


def test_missing_path_is_not_taken_for_a_hub_id():
    with pytest.raises(ModelLoadError, match="no such folder or file"):
        resolve_model("/nonexistent/folder")


def test_engine_takes_a_hub_id_and_revision(hub):
    from torch_runner import Engine, SamplingParams

    _, snapshot = hub
    engine = Engine(model=REPO, revision="v1", device="cpu", max_total_tokens=256)
    assert engine.model_path == str(snapshot.resolve())
    local = Engine(model=str(snapshot), device="cpu", max_total_tokens=256)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    (from_hub,) = engine.generate(["Hello"], params)
    (from_folder,) = local.generate(["Hello"], params)
    assert from_hub.token_ids == from_folder.token_ids
