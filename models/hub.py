"""`--model` as vLLM takes it: a local folder, a .gguf file, or a Hugging Face Hub model ID.

A Hub ID resolves through `huggingface_hub.snapshot_download` and the standard cache (`HF_HOME`,
`HF_HUB_CACHE`), fetching only what the loader reads (`MODEL_FILES`). With `HF_HUB_OFFLINE=1`,
or when the Hub cannot be reached, a cached snapshot is used and an uncached one is one
`ModelLoadError` line saying how to fetch it. Every check here runs before a weight is read, so
a wrong name or revision fails in a second, not after a load. GGUF files pass through untouched
(their loading belongs to the quantized-weights loader).
"""

from __future__ import annotations

import os
from pathlib import Path

from models.errors import ModelLoadError
from models.safetensors_io import checkpoint_files

# What load_model and AutoTokenizer read: weights, configs, tokenizer files and chat templates.
MODEL_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
)
TOKENIZER_FILES = tuple(p for p in MODEL_FILES if "safetensors" not in p and p != "config.json")
TOKENIZER_FILES += ("config.json",)  # AutoTokenizer reads model_type from it
GGUF_SUFFIX = ".gguf"
# any one of these makes a folder a tokenizer AutoTokenizer can load (config.json is optional)
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_model(
    name: str | os.PathLike,
    *,
    revision: str | None = None,
    load_format: str = "safetensors",
    flag: str = "--model",
) -> Path:
    """A loadable local path for `name`, or a ModelLoadError in one line (nothing is loaded).

    Local folders must hold config.json and (unless load_format is "dummy") safetensors
    weights; a .gguf file is returned as is; anything else is taken as a Hub model ID.
    """
    return _resolve(name, revision, MODEL_FILES, flag, needs_weights=load_format != "dummy")


def resolve_tokenizer(name: str | os.PathLike, *, revision: str | None = None) -> Path:
    """Like `resolve_model`, for a tokenizer: only the tokenizer files are fetched."""
    return _resolve(name, revision, TOKENIZER_FILES, "--tokenizer", needs_weights=False)


def is_hub_id(name: str) -> bool:
    """Not an existing path and shaped like `org/name` or `name` (what the Hub accepts)."""
    if os.path.exists(os.path.expanduser(name)) or _looks_like_path(name):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", ".", "~", "\\"))
        or name.count("/") > 1
        or name.endswith(GGUF_SUFFIX)
        or os.sep != "/"
        and os.sep in name
    )


def _resolve(
    name: str | os.PathLike,
    revision: str | None,
    patterns: tuple[str, ...],
    flag: str,
    *,
    needs_weights: bool,
) -> Path:
    text = os.fspath(name)
    path = Path(text).expanduser()
    if path.exists():
        if revision is not None:
            raise ModelLoadError(
                f"{flag} {text} is a local path; --revision applies only to Hub model IDs"
            )
        return _check_local(path, flag, needs_weights=needs_weights)
    if not is_hub_id(text):
        raise ModelLoadError(
            f"{flag} {text}: no such folder or file (and it is not a Hub model ID like org/name)"
        )
    folder = _snapshot(text, revision, patterns, flag)
    return _check_local(folder, flag, needs_weights=needs_weights, hub_id=text)


def _check_local(path: Path, flag: str, *, needs_weights: bool, hub_id: str | None = None) -> Path:
    where = f"{hub_id} ({path})" if hub_id else str(path)
    if path.is_file():
        if path.suffix == GGUF_SUFFIX:
            return path
        raise ModelLoadError(f"{flag} {where} is a file; expected a model folder or a .gguf file")
    if flag.lstrip("-") == "tokenizer":
        if not any((path / name).is_file() for name in TOKENIZER_MARKERS):
            raise ModelLoadError(
                f"{flag} {where} holds no tokenizer ({', '.join(TOKENIZER_MARKERS)})"
            )
        return path
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob(f"*{GGUF_SUFFIX}"))
        if len(ggufs) == 1:  # a folder holding one GGUF checkpoint (models/gguf_loader.py)
            return path / ggufs[0]
        hint = f"; for a GGUF checkpoint pass the file ({ggufs[0]})" if ggufs else ""
        raise ModelLoadError(f"{flag} {where} has no config.json (not a Hugging Face folder){hint}")
    if needs_weights:
        try:
            checkpoint_files(path)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{flag} {hub_id + ': ' if hub_id else ''}{exc}") from None
    return path


def _snapshot(repo_id: str, revision: str | None, patterns: tuple[str, ...], flag: str) -> Path:
    """snapshot_download with the standard cache; every failure becomes one line."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    shown = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    fetch = f"`hf download {repo_id}" + (f" --revision {revision}" if revision else "") + "`"
    try:
        return Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns))
        ).resolve()
    except RevisionNotFoundError:
        raise ModelLoadError(
            f"{flag} {repo_id}: revision {revision!r} does not exist on the Hub"
        ) from None
    except GatedRepoError:
        raise ModelLoadError(
            f"{flag} {repo_id} is gated: accept its terms on huggingface.co and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"{flag} {repo_id}: no such model on the Hub (a private one needs HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError:
        cache = Path(constants.HF_HUB_CACHE)
        why = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        cached = _cached_revisions(cache, repo_id)
        if cached and revision is not None:
            raise ModelLoadError(
                f"{flag} {repo_id}: revision {revision!r} is not in the Hugging Face cache "
                f"({cache}; cached: {', '.join(cached)}) and {why}; fetch it with {fetch}"
            ) from None
        raise ModelLoadError(
            f"{flag} {shown} is not in the Hugging Face cache ({cache}) and {why}; "
            f"fetch it with {fetch} (with network access), or pass a local folder"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:  # incomplete snapshot, disk, bad input
        message = " ".join(str(exc).split())
        raise ModelLoadError(f"{flag} {shown}: {message}") from None


def _cached_revisions(cache: Path, repo_id: str) -> list[str]:
    """Branch/tag names under refs/ and commit folders under snapshots/ of a cached repo."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    refs = sorted(p.name for p in (storage / "refs").glob("*") if p.is_file())
    snapshots = sorted(p.name[:12] for p in (storage / "snapshots").glob("*") if p.is_dir())
    return refs + snapshots
