"""OpenAI-compatible servers side by side: `minedraft up --http-port` in each mode and vLLM's OpenAI server
(`vllm serve`, from its CPU build's venv: `vllm_env`), with the same models (the bundled pair), the same draft
settings (draft model, k tokens) and as many requests running at once (MineDraft: two batches of half that).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from minedraft.bench.vllm_env import peer_environment
from minedraft.config import BUNDLED_DRAFT, BUNDLED_TARGET, REPO_ROOT
from minedraft.launcher import free_port

SERVED_NAME = "minedraft-target"
# name -> (server, speculative config of ours / extra keys of vLLM's, or None for plain decoding)
SERVERS: dict[str, tuple[str, dict | None]] = {
    "vllm-ar": ("vllm", None),
    "vllm-sd": ("vllm", {"method": "draft_model", "model": str(BUNDLED_DRAFT)}),
    "ar": ("ours", None),
    "sd": ("ours", {}),
    "sd-fixed": ("ours", {"adaptive": False}),
    "sd-k2-fixed": ("ours", {"adaptive": False, "num_speculative_tokens": 2}),
    "minedraft-fixed": ("ours", {"is_parallel": True, "adaptive": False}),
    "pearl": ("ours", {"is_parallel": True, "force_pearl": True}),
    "minedraft": ("ours", {"is_parallel": True}),
    # The verifier runs the draft model in its own process (`--colocate-drafter`, on CPU the default of `up`), or a
    # drafter service runs beside it (`--no-colocate-drafter`, as pods run them).
    "sd-fixed-colocated": ("ours", {"adaptive": False}),
    "minedraft-colocated": ("ours", {"is_parallel": True}),
    "sd-fixed-separate": ("ours", {"adaptive": False}),
    "minedraft-fixed-separate": ("ours", {"is_parallel": True, "adaptive": False}),
    "minedraft-separate": ("ours", {"is_parallel": True}),
    "sd+eagle3": ("ours", {"method": "eagle3"}),
    "minedraft+eagle3": ("ours", {"is_parallel": True, "method": "eagle3"}),
}


@dataclass
class Server:
    """A server process and the rounds measured against it (each a client's result JSON, vLLM's keys)."""

    name: str
    process: subprocess.Popen
    url: str
    rounds: list[dict] = field(default_factory=list)
    ours: list[dict] = field(default_factory=list)  # the same rounds measured by `minedraft bench`
    by_load: dict[int, list[dict]] = field(default_factory=dict)  # rounds per load (requests in flight)
    crowded: bool = False  # its rounds run beside a busy neighbour process (the same server as its quiet twin)

    def beside_a_neighbour(self) -> Server:
        """The same server, for rounds run beside a busy neighbour process: its results kept apart."""
        return Server(f"{self.name}+neighbour", self.process, self.url, crowded=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def median(self, key: str, ours: bool = False) -> float:
        values = [r[key] for r in (self.ours if ours else self.rounds) if r.get(key) is not None]
        return statistics.median(values) if values else float("nan")


def start_server(name: str, *, k: int, max_num_seqs: int, vllm_python: str, logs: Path,
                 prefix_caching: bool = False, label: str | None = None) -> Server:
    """Server `name` of SERVERS on a free port, logging to `logs/label.log` (`label` names the server too;
    default `name`). `prefix_caching` off by default: benchmark rounds repeat their prompts."""
    kind, spec = SERVERS[name]
    port = free_port()
    caching = "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"
    if kind == "ours":
        spec_json = json.dumps({"num_speculative_tokens": k, **spec}) if spec is not None else "null"
        batch = max_num_seqs // 2 if name.startswith("minedraft") else max_num_seqs  # as many at once, two batches
        command = [sys.executable, "-m", "minedraft", "up", "--http-port", str(port), "--port", str(free_port()),
                   "--metrics-port", "0", "--speculative-config", spec_json, "--max-num-seqs", str(batch),
                   "--log-level", "WARNING", caching, *_drafter_placement(name)]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "services")}
    else:
        command = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(BUNDLED_TARGET),
                   "--served-model-name", SERVED_NAME, "--port", str(port), "--host", "127.0.0.1",
                   "--max-num-seqs", str(max_num_seqs), "--dtype", "float32", caching]  # fmt: skip
        if spec is not None:
            command += ["--speculative-config", json.dumps({**spec, "num_speculative_tokens": k})]
        env = peer_environment()
    label = label or name
    log = open(logs / f"{label}.log", "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    return Server(label, process, f"http://127.0.0.1:{port}")


def _drafter_placement(name: str) -> list[str]:
    """`up`'s flag for where a server of ours runs its draft model (none: `up`'s default)."""
    if name.endswith("-colocated"):
        return ["--colocate-drafter"]
    return ["--no-colocate-drafter"] if name.endswith("-separate") else []


def wait_healthy(server: Server, timeout: float, logs: Path) -> None:
    """Until `server` answers /health, or SystemExit when it exits or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SystemExit(f"{server.name} exited; see {logs / (server.name + '.log')}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"{server.name} was not healthy within {timeout:.0f}s; see {logs / (server.name + '.log')}")
