"""Writes acceptance_bundled_pair.json: for the first 64 held-out prompts (models/prompts/heldout.jsonl) and each of
the first 64 positions of the target's greedy continuation, how many tokens of the draft's greedy window of 4 from
there match the target's own (0-4). The step-shape tests replay it: acceptance as the bundled pair has it, in runs.

    python tests/data/make_acceptance_trace.py      # a few minutes on 2 cores (Hugging Face transformers)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from minedraft.model.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, POSITIONS, WINDOW = 64, 64, 4


def _greedy(model, ids: list[int], tokens: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def main() -> None:
    tokenizer = load_tokenizer(str(ROOT / "models/minedraft-target"))
    target, draft = (AutoModelForCausalLM.from_pretrained(str(ROOT / "models" / name), dtype=torch.float32).eval()
                     for name in ("minedraft-target", "minedraft-draft"))  # fmt: skip
    lines = (ROOT / "models/prompts/heldout.jsonl").read_text().splitlines()[:PROMPTS]
    traces = []
    with torch.no_grad():
        for line in lines:
            ids = tokenizer.encode(json.loads(line)["prompt"])
            continuation = _greedy(target, ids, POSITIONS + WINDOW)
            trace = []
            for position in range(POSITIONS):
                window = _greedy(draft, ids + continuation[:position], WINDOW)
                matched = 0
                while matched < WINDOW and window[matched] == continuation[position + matched]:
                    matched += 1
                trace.append(matched)
            traces.append(trace)
    (Path(__file__).parent / "acceptance_bundled_pair.json").write_text(json.dumps(traces) + "\n")


if __name__ == "__main__":
    main()
