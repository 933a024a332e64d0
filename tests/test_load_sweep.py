"""benchmarks/load_sweep.py's table from measured results (the sweep itself needs vLLM's CPU build and half an
hour, so it is not run here): engines missing at a load show as '-', adaptive is compared with our best fixed
mode and with vLLM's best at each load."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import load_sweep  # noqa: E402


def _row(tok_s: float, mean_k: float | None = None) -> dict:
    return {"tok_s": tok_s, "mean_k": mean_k}


def test_table_compares_adaptive_with_our_best_fixed_mode_and_vllms_best() -> None:
    results = {
        1: {"vllm-ar": _row(100), "ar": _row(80), "sd-fixed": _row(120), "sd": _row(114, 3.5)},
        4: {"vllm-ar": _row(300), "vllm-sd": _row(400), "ar": _row(250), "sd-fixed": _row(300),
            "sd": _row(320, 2.25), "minedraft-fixed": _row(200), "minedraft": _row(210, 1.0)},
    }  # fmt: skip
    lines = load_sweep.table(results).splitlines()
    assert lines[0] == "| engine | 1 in flight | 4 in flight |"
    assert "| sd | 114 (k 3.5) | 320 (k 2.2) |" in lines
    assert "| minedraft | - | 210 (k 1.0) |" in lines  # MineDraft's two batches start at 2 in flight
    assert "| sd (adaptive) / our best fixed | 0.95 | 1.07 |" in lines
    assert "| sd (adaptive) / vLLM's best | 1.14 | 0.80 |" in lines
    assert "| minedraft (adaptive) / our best fixed | - | 0.70 |" in lines
