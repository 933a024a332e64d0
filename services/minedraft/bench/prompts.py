"""Benchmark requests: the bundled held-out code prompts, a ShareGPT-format JSON file, a JSON-lines file of
prompts, or random prompts of chosen token lengths (`--dataset random`)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from minedraft.config import BUNDLED_MODELS_DIR
from minedraft.model.tokenizer import Tokenizer

BUNDLED_PROMPTS = BUNDLED_MODELS_DIR / "prompts" / "heldout.jsonl"
RANDOM = "random"


@dataclass(frozen=True)
class BenchRequest:
    """One request of a run. `prompt_len`: its tokens when the dataset knows them (random), else the
    server's usage tells; `output_len`: its max_tokens when the dataset sets one (random), else the run's."""

    prompt: str
    prompt_len: int | None = None
    output_len: int | None = None


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


def lengths(mean: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    """n lengths drawn uniformly from [mean * (1 - range_ratio), mean * (1 + range_ratio)], at least 1."""
    if mean < 1 or not 0 <= range_ratio < 1:
        raise ValueError(f"lengths need mean >= 1 and 0 <= range ratio < 1, got {mean} and {range_ratio}")
    low, high = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def random_requests(
    tokenizer: Tokenizer, n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[BenchRequest]:
    """n prompts of random tokens, about `input_len` tokens each (decoded, so re-tokenizing may merge a few),
    each asking for `output_len` tokens; lengths spread by `range_ratio` (see `lengths`)."""
    rng = random.Random(seed)
    inputs, outputs = lengths(input_len, range_ratio, n, rng), lengths(output_len, range_ratio, n, rng)
    vocab = tokenizer.vocab_size
    requests = []
    for want, out in zip(inputs, outputs):
        ids = [rng.randrange(vocab) for _ in range(want)]
        # Decoded text re-tokenizes to a different count (merges, skipped special tokens): cut to the length.
        ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:want]
        prompt = tokenizer.decode(ids)
        requests.append(BenchRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), out))
    return requests
