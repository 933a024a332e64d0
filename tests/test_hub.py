"""Models by hub id, resolved from a local Hugging Face cache that the test writes in the hub's own layout
(models--org--name/refs/<ref>, snapshots/<commit>/...), with HF_HUB_OFFLINE set: no network anywhere."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minedraft import LLM, SamplingParams
from minedraft.model.checkpoint import CheckpointNotFoundError
from minedraft.model.hub import is_hub_id, local_folder

from tiny_models import make_tiny_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(cache: Path, repo_id: str, checkpoint: Path) -> Path:
    """`checkpoint`'s files as the hub library caches `repo_id` at main; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(checkpoint, snapshot)
    return snapshot


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    write_hub_cache(cache, "tiny-org/tiny-target", make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=2))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_and_paths_are_told_apart(tmp_path) -> None:
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("org/name@v1.0")
    assert not is_hub_id("/ckpt/Qwen3-8B") and not is_hub_id("models") and not is_hub_id("./org/name")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id(str(tmp_path / "org" / "name"))


def test_a_cached_hub_id_serves_like_its_folder(hub_cache, tmp_path) -> None:
    folder = local_folder("tiny-org/tiny-target")
    assert folder == hub_cache / "models--tiny-org--tiny-target" / "snapshots" / COMMIT
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_id = LLM(model="tiny-org/tiny-target", device="cpu").generate(["abc"], params, use_tqdm=False)
    by_folder = LLM(model=str(folder), device="cpu").generate(["abc"], params, use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == by_folder[0].outputs[0].token_ids


def test_an_unknown_id_offline_is_one_clear_error(hub_cache) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"model 'tiny-org/missing' is neither a folder nor in the "
                                                      r"Hugging Face cache, and HF_HUB_OFFLINE is set"):
        local_folder("tiny-org/missing")


def test_the_command_line_takes_a_hub_id(hub_cache) -> None:
    run = lambda model: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "minedraft", "generate", "--model", model, "--speculative-config", "null",
         "--prompt", "abc", "--temperature", "0", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run("tiny-org/tiny-target").returncode == 0
    missing = run("tiny-org/missing")
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "model 'tiny-org/missing' is neither a folder nor in the Hugging Face cache" in missing.stderr
