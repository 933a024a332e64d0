"""The scheduler's periodic stats line: what an operator reads in the log while requests run (as vLLM
logs its engine's throughput and load every few seconds)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from minedraft.engine.plans import StepResult


@dataclass
class StatsLog:
    """Sums steps between two lines; `line` returns one every `interval_s` while there was work."""

    interval_s: float
    _since: float = field(default_factory=time.monotonic)
    _tokens: int = 0
    _draft_tokens: int = 0
    _accepted: int = 0
    _prefix_queries: int = 0  # the verifier's, in prompt tokens
    _prefix_hits: int = 0
    _worker_seconds: dict[str, float] = field(default_factory=dict)
    _idle_seconds: dict[str, float] = field(default_factory=dict)

    def record(self, result: StepResult, generated_tokens: int, was_busy: bool) -> None:
        """`was_busy`: requests ran before this step, so the workers' wait for it counts as idle (the wait of
        a quiet server does not, and an interval starts with the first step after one)."""
        if not was_busy and not self._worker_seconds and not self._tokens:
            self._since = time.monotonic() - result.step_seconds
        self._tokens += generated_tokens
        for verified in result.verified:
            self._draft_tokens += verified.num_draft_tokens
            self._accepted += verified.num_accepted
        self._prefix_queries += result.prefix_cache_queries.get("verifier", 0)
        self._prefix_hits += result.prefix_cache_hits.get("verifier", 0)
        for role, seconds in result.worker_seconds.items():
            self._worker_seconds[role] = self._worker_seconds.get(role, 0.0) + seconds
            idle = result.idle_seconds.get(role, 0.0) if was_busy else 0.0
            self._idle_seconds[role] = self._idle_seconds.get(role, 0.0) + idle

    def line(self, running: int, waiting: int, kv_usage: float | None) -> str | None:
        """The line for the interval that just ended, or None (too early, nothing ran, or turned off)."""
        now = time.monotonic()
        if self.interval_s <= 0 or now - self._since < self.interval_s or not self._tokens:
            return None
        parts = [f"generation {self._tokens / (now - self._since):.1f} tok/s", f"running {running}",
                 f"waiting {waiting}"]  # fmt: skip
        if kv_usage is not None:
            parts.append(f"KV cache {kv_usage:.1%} used")
        if self._draft_tokens:
            parts.append(f"draft acceptance {self._accepted / self._draft_tokens:.1%}")
        if self._prefix_queries:
            parts.append(f"prefix cache hit rate {self._prefix_hits / self._prefix_queries:.1%}")
        for role, seconds in sorted(self._worker_seconds.items()):
            idle = self._idle_seconds[role]
            parts.append(f"{role} idle {idle / (seconds + idle):.1%}" if seconds + idle else f"{role} idle -")
        self._reset()
        return ", ".join(parts)

    def _reset(self) -> None:
        self._since, self._tokens, self._draft_tokens, self._accepted = time.monotonic(), 0, 0, 0
        self._prefix_queries = self._prefix_hits = 0
        self._worker_seconds, self._idle_seconds = {}, {}
