"""The shell blocks of README.md, docs/ and benchmarks/README.md marked `<!-- runnable -->` run as written and
succeed, so that the commands the docs show cannot drift from the code.

Mark only blocks that are quick and safe on a CPU. Each runs under `bash -euo pipefail` in a fresh folder, in
its own process group (killed afterwards, so a server it forgot cannot outlive it); the well-known ports the
docs use are moved to free ones, so that a block can run beside other servers.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from minedraft.stack.local import free_port

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PORTS = ("50051", "8000", "7450")
_BLOCK = re.compile(re.escape(MARKER) + r"\n```(?:bash|sh|shell)\n(.*?)\n```", re.S)


def runnable_blocks() -> list[tuple[str, str]]:
    """(file:line, code) of every marked block."""
    blocks = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            blocks.append((f"{path.relative_to(ROOT)}:{line}", match.group(1)))
    return blocks


def test_every_marker_sits_on_a_shell_block() -> None:
    markers = sum(path.read_text(encoding="utf-8").count(MARKER) for path in DOCS)
    assert markers == len(runnable_blocks()) >= 1


def _free_ports(code: str) -> str:
    for port in PORTS:
        code = re.sub(rf"(?<![\d.]){port}(?!\d)", str(free_port()), code)
    return code


@pytest.mark.parametrize(("where", "code"), runnable_blocks(), ids=[w for w, _ in runnable_blocks()])
def test_runnable_block(where: str, code: str, tmp_path: Path) -> None:
    process = subprocess.Popen(["bash", "-euo", "pipefail", "-c", _free_ports(code)], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever the block left running
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, f"{where} failed:\n{output[-4000:]}"
