"""The one-command GPU suite, run here as CI runs it: --dry-run, without a GPU. The steps that need CUDA
must say so (skipped, with the reason); every other step runs for real on the CPU and passes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("triton")


def test_dry_run_runs_what_it_can_and_names_what_it_skips(tmp_path) -> None:
    out = tmp_path / "suite"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), "--dry-run", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = json.loads(out.with_suffix(".json").read_text())["steps"]
    assert {name: step["status"] for name, step in steps.items()} == {
        "numerics": "skipped", "triton": "passed", "quant": "passed", "moe": "passed", "graphs": "skipped",
        "greedy": "passed",
        "bench": "passed", "shapes": "passed", "floor": "skipped",
    }  # fmt: skip
    assert steps["numerics"]["reason"] == steps["floor"]["reason"] == steps["graphs"]["reason"] == "dry run"
    assert steps["triton"]["interpreted"] and steps["greedy"]["outputs_differing_from_ar"]["minedraft+pard"] == 0
    assert steps["greedy"]["outputs_differing_from_ar"]["minedraft+eagle3"] == 0
    assert set(steps["bench"]["offline_tok_s"]) == {"ar", "sd", "minedraft", "sd+pard", "sd+eagle3", "minedraft+eagle3"}
    assert "| triton | passed |" in out.with_suffix(".md").read_text()
