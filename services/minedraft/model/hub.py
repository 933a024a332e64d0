"""Models by name: a Hugging Face hub id (`org/name`, optionally `org/name@revision`) in place of a folder.

An id is looked up in the local Hugging Face cache first (`HF_HUB_CACHE`, or the hub library's default),
and downloaded into it when that finds nothing and the network is allowed (not with `HF_HUB_OFFLINE=1`),
with the hub library's progress bars. Only what serving reads is fetched: the JSON files (config,
generation config, tokenizer, shard index) and the safetensors weights; pickled weights never are.
A path that exists, or that does not look like an id, is returned as it is.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from minedraft.model.errors import CheckpointNotFoundError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_SERVING_FILES = ["*.json", "*.safetensors", "*.jinja"]


def is_hub_id(name: str | Path) -> bool:
    """`org/name[@revision]` that is not a path on this machine."""
    text = str(name)
    return bool(_HUB_ID.match(text)) and not Path(text).expanduser().exists()


def local_folder(name: str | Path) -> Path:
    """The folder to read `name` from: itself, or a hub id's snapshot in the local cache (downloaded if need be)."""
    if not is_hub_id(name):
        return Path(name).expanduser()
    name = str(name)
    repo_id, _, revision = name.partition("@")
    from huggingface_hub import snapshot_download

    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, cache_dir=cache_dir,
                                      allow_patterns=_SERVING_FILES, local_files_only=True))  # fmt: skip
    except Exception as cached_error:  # noqa: BLE001 (the hub library raises several kinds for "not cached")
        if _offline():
            raise CheckpointNotFoundError(
                f"model {name!r} is neither a folder nor in the Hugging Face cache, and HF_HUB_OFFLINE is set: "
                f"download it first (huggingface-cli download {repo_id}) or pass a folder"
            ) from cached_error
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, cache_dir=cache_dir,
                                      allow_patterns=_SERVING_FILES))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 (network, authentication, unknown repository)
        raise CheckpointNotFoundError(
            f"model {name!r} is neither a folder nor in the Hugging Face cache, and downloading it failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); pass a folder, "
            f"or download it where the network allows (huggingface-cli download {repo_id})"
        ) from exc


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
