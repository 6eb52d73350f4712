"""A Hugging Face Hub cache built by hand, laid out exactly as `huggingface_hub` lays it out.

    $HF_HOME/hub/models--ORG--NAME/
        blobs/<sha256>                       file contents, one per distinct file
        refs/<branch or tag>                 the commit hash it points at (no newline)
        snapshots/<commit>/<file> -> ../../blobs/<sha256>   relative symlinks

Tests point `HF_HOME` at it with `HF_HUB_OFFLINE=1` (or an unreachable `HF_ENDPOINT`), so Hub IDs
resolve with no network; `huggingface_hub.scan_cache_dir` reading it back is the check that the
layout is the real one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_cache(
    hf_home: Path,
    repo_id: str,
    source: Path,
    *,
    commit: str = COMMIT,
    refs: tuple[str, ...] = ("main",),
    skip: tuple[str, ...] = (),
) -> Path:
    """Copy the files of `source` into the cache as `repo_id` at `commit`; returns the snapshot."""
    storage = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = storage / "blobs", storage / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.rglob("*")):
        relative = file.relative_to(source)
        if not file.is_file() or relative.name in skip:
            continue
        data = file.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(blobs / digest, link.parent)
        link.symlink_to(target)
    (storage / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return snapshot
