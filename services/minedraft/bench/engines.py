"""Offline engines side by side: ours (`minedraft.LLM`, in each mode) and vLLM's CPU build (`vllm.LLM`).

Every engine runs in a process of its own (`engine_worker.py`; vLLM's from its venv, `vllm_env`) and loads
once, one after the other, so that start-up work does not overlap. After each engine's warm-up, the rounds
interleave the engines (`rounds.interleaved`) on the same prompts, and each engine's median round is what
a comparison reports.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minedraft.bench.prompts import BUNDLED_PROMPTS
from minedraft.bench.rounds import interleaved
from minedraft.bench.vllm_env import VENV, ensure_venv, peer_environment
from minedraft.config import (
    BUNDLED_DRAFT,
    BUNDLED_EAGLE3,
    BUNDLED_P_EAGLE,
    BUNDLED_PARD_DRAFT,
    BUNDLED_TARGET,
    REPO_ROOT,
)

WORKER = Path(__file__).with_name("engine_worker.py")
LOG_DIR = REPO_ROOT / ".bench-logs"

# name -> (engine, speculative config of ours / vLLM's or None for plain decoding, our strict kernels).
# Ours speculate with adaptive k (at most k) unless named -fixed; -k2: at most / always 2.
ENGINES: dict[str, tuple[str, dict | None, bool]] = {
    "vllm-ar": ("vllm", None, False),
    "vllm-sd": ("vllm", {"method": "draft_model", "model": str(BUNDLED_DRAFT)}, False),
    "vllm-sd-k2": ("vllm", {"method": "draft_model", "model": str(BUNDLED_DRAFT), "num_speculative_tokens": 2}, False),
    "vllm-pard": ("vllm", {"method": "draft_model", "model": str(BUNDLED_PARD_DRAFT), "parallel_drafting": True},
                  False),
    "vllm-eagle3": ("vllm", {"method": "eagle3", "model": str(BUNDLED_EAGLE3)}, False),
    "vllm-p-eagle": ("vllm", {"method": "eagle3", "model": str(BUNDLED_P_EAGLE), "parallel_drafting": True}, False),
    "ar": ("ours", None, False),
    "sd": ("ours", {}, False),
    "sd-fixed": ("ours", {"adaptive": False}, False),
    "sd-k2-fixed": ("ours", {"adaptive": False, "num_speculative_tokens": 2}, False),
    "pearl": ("ours", {"is_parallel": True, "force_pearl": True}, False),
    "minedraft": ("ours", {"is_parallel": True}, False),
    "minedraft-fixed": ("ours", {"is_parallel": True, "adaptive": False}, False),
    "minedraft+tetris": ("ours", {"is_parallel": True, "tetris": True}, False),
    "sd+pard": ("ours", {"parallel_drafting": True}, False),
    "pearl+pard": ("ours", {"is_parallel": True, "force_pearl": True, "parallel_drafting": True}, False),
    "minedraft+pard": ("ours", {"is_parallel": True, "parallel_drafting": True}, False),
    "sd+pard-fixed": ("ours", {"parallel_drafting": True, "adaptive": False}, False),
    "minedraft+pard-fixed": ("ours", {"is_parallel": True, "parallel_drafting": True, "adaptive": False}, False),
    "sd+eagle3": ("ours", {"method": "eagle3"}, False),
    "sd+eagle3-fixed": ("ours", {"method": "eagle3", "adaptive": False}, False),
    "pearl+eagle3": ("ours", {"is_parallel": True, "force_pearl": True, "method": "eagle3"}, False),
    "minedraft+eagle3": ("ours", {"is_parallel": True, "method": "eagle3"}, False),
    "minedraft+eagle3-fixed": ("ours", {"is_parallel": True, "method": "eagle3", "adaptive": False}, False),
    "sd+p-eagle-fixed": ("ours", {"method": "eagle3", "parallel_drafting": True, "adaptive": False}, False),
    "minedraft+p-eagle-fixed": ("ours", {"is_parallel": True, "method": "eagle3", "parallel_drafting": True,
                                         "adaptive": False}, False),
    # A draft of random weights, the draft model's shape: speculation that never pays (adaptive: plain decoding).
    "sd-random": ("ours", {"model": "random"}, False),
    "minedraft-random": ("ours", {"is_parallel": True, "model": "random"}, False),
    "ar-strict": ("ours", None, True),
    "sd-strict": ("ours", {}, True),
    "minedraft-strict": ("ours", {"is_parallel": True}, True),
}


@dataclass(frozen=True)
class EngineSettings:
    """What every engine of a comparison shares: the first `num_prompts` bundled held-out prompts, greedy, EOS
    ignored. Ours in MineDraft modes keep two batches of half `max_num_seqs`. Prefix caching is off unless
    asked: the rounds repeat the same prompts, so a cache would skip their prefill."""

    num_prompts: int = 32
    max_tokens: int = 64
    max_num_seqs: int = 32
    k: int = 4
    device: str = "cpu"  # ours; vLLM's CPU build runs on the CPU
    warmup: int = 1  # untimed runs over all prompts per engine, after loading
    prefix_caching: bool = False


@dataclass
class Engine:
    """One engine in its own process, driven over its stdin / stdout one JSON line at a time."""

    name: str
    process: subprocess.Popen
    rounds: list[dict] = field(default_factory=list)
    crowded: list[dict] = field(default_factory=list)  # rounds run beside a busy neighbour process

    @classmethod
    def start(cls, name: str, python: str, settings: EngineSettings, log: Path) -> Engine:
        kind, spec, strict = ENGINES[name]
        if spec is not None:
            spec = {"num_speculative_tokens": settings.k, **spec}
        job = json.dumps({"kind": kind, "spec": spec, "batch_invariant": strict, **asdict(settings),
                          "target": str(BUNDLED_TARGET), "draft": str(BUNDLED_DRAFT),
                          "prompts": str(BUNDLED_PROMPTS)})  # fmt: skip
        process = subprocess.Popen(
            [python, str(WORKER), job], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
            text=True, env=peer_environment() if kind == "vllm" else None, cwd=REPO_ROOT,
        )  # fmt: skip
        return cls(name, process)

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited (code {self.process.wait()}); see its log")
        return json.loads(line)

    def run(self, crowded: bool = False) -> dict:
        """One timed `generate` over all prompts; `crowded`: beside a busy neighbour process."""
        with busy_neighbour(crowded):
            return self.ask("run")

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()

    @property
    def seconds(self) -> float:
        return statistics.median(r["seconds"] for r in self.rounds)

    @property
    def tokens(self) -> list[list[int]]:
        return self.rounds[-1]["tokens"]


def compare(names: list[str], settings: EngineSettings, *, rounds: int, settle_s: float, venv: Path = VENV,
            log_dir: Path = LOG_DIR, neighbour: bool = False) -> list[Engine]:
    """The engines `names` loaded, warmed up and timed in `rounds` interleaved rounds (`settle_s` idle before
    each run: the last engine's OpenMP threads spin a while); with `neighbour` each engine runs twice a round,
    quiet and beside a busy process. Every engine is stopped before this returns."""
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}; choose from {list(ENGINES)}")
    vllm_python = str(ensure_venv(venv)) if any(ENGINES[n][0] == "vllm" for n in names) else ""
    log_dir.mkdir(parents=True, exist_ok=True)
    engines: dict[str, Engine] = {}
    try:
        for name in names:
            python = vllm_python if ENGINES[name][0] == "vllm" else sys.executable
            print(f"loading {name} (log: {log_dir / name}.log)", flush=True)
            engines[name] = Engine.start(name, python, settings, log_dir / f"{name}.log")
            engines[name].ask("ready")
        runs = {(name, crowded): (lambda _round, e=engine, c=crowded: e.run(c))
                for name, engine in engines.items() for crowded in ((False, True) if neighbour else (False,))}

        def report(round_: int, key: tuple[str, bool], result: dict) -> None:
            beside = " beside a busy neighbour" if key[1] else ""
            speed = result["output_tokens"] / result["seconds"]
            print(f"round {round_ + 1}/{rounds}: {key[0]:<17} {speed:8.1f} tok/s{beside}", flush=True)

        timed = interleaved(runs, rounds, settle_s=settle_s, report=report)
    finally:
        for engine in engines.values():
            engine.stop()
    for name, engine in engines.items():
        engine.rounds, engine.crowded = timed[name, False], timed.get((name, True), [])
    return list(engines.values())


@contextlib.contextmanager
def busy_neighbour(on: bool) -> Iterator[None]:
    """A CPU-bound process (a busy loop) running beside the block, when `on`."""
    if not on:
        yield
        return
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        yield
    finally:
        neighbour.kill()
        neighbour.wait()
