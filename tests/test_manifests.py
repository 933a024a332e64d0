"""The checked-in plain manifests (k8s/*.yaml) must be exactly what the chart renders now."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rendered_manifests_are_fresh() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/render_manifests.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
