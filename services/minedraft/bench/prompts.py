"""Benchmark prompts: the bundled held-out code prompts, or a ShareGPT-format JSON file."""

from __future__ import annotations

import json
from pathlib import Path

from minedraft.config import BUNDLED_MODELS_DIR

BUNDLED_PROMPTS = BUNDLED_MODELS_DIR / "prompts" / "heldout.jsonl"


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[str]:
    """Read prompts from a JSON-lines file of {"prompt": ...} objects (default: the bundled set) or a
    ShareGPT JSON file (a list of {"conversations": [{"from": "human", "value": ...}, ...]})."""
    path = Path(path) if path else BUNDLED_PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    else:
        prompts = [_first_human_turn(item) for item in json.loads(text)]
        prompts = [p for p in prompts if p]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts[:limit] if limit else prompts


def _first_human_turn(item: dict) -> str | None:
    for turn in item.get("conversations", []):
        if turn.get("from") in ("human", "user"):
            return turn.get("value")
    return None
