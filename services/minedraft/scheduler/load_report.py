"""What the step loop tells of the engine's load after each step: Prometheus gauges, the periodic stats line, and
adaptive speculation's state for the frontends."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from minedraft.engine.engine import LLMEngine
from minedraft.engine.request import Request
from minedraft.metrics import Metrics
from minedraft.scheduler.stats_log import StatsLog

log = logging.getLogger("minedraft.scheduler")


class LoadReport:
    def __init__(self, engine: LLMEngine, metrics: Metrics | None, stats_interval_s: float) -> None:
        self.engine = engine
        self.metrics = metrics
        self.stats_log = StatsLog(stats_interval_s)
        self._preemptions_seen = 0
        self._speculation_at = 0.0

    def record_load(self) -> int:
        """Requests waiting and running, KV usage and preemptions, as the engine holds them now; the number
        waiting."""
        batches = self.engine.pipeline.batches
        waiting = len(batches.waiting)
        if self.metrics is None:
            return waiting
        self.metrics.waiting.set(waiting)
        self.metrics.running.set(batches.num_running)
        if batches.budget is not None:
            self.metrics.kv_usage.set(batches.used_blocks / batches.budget.num_blocks)
            self.metrics.record_cache_config(batches.budget.num_blocks, batches.budget.block_size)
        self.metrics.preemptions.inc(self.engine.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = self.engine.num_preemptions
        if self.engine.config.enable_lora:
            running = (r for batch in batches.batches for r in batch)
            self.metrics.record_lora(_adapters(running), _adapters(batches.waiting), self.engine.config.max_loras)
        return waiting

    def log_stats(self, generated_tokens: int, was_busy: bool) -> None:
        self.stats_log.record(self.engine.last_step, generated_tokens, was_busy)
        batches = self.engine.pipeline.batches
        kv_usage = batches.used_blocks / batches.budget.num_blocks if batches.budget is not None else None
        line = self.stats_log.line(batches.num_running, len(batches.waiting), kv_usage)
        if line is not None:
            log.info("%s", line)

    def speculation(self) -> dict | None:
        """A snapshot of the controller for the frontends' threads, at most once a second (it solves the fits);
        None when none is due."""
        now = time.monotonic()
        pipeline = self.engine.pipeline
        if pipeline.controller is None or now - self._speculation_at < 1.0:
            return None
        self._speculation_at = now
        return {**pipeline.controller.describe(),
                "steps_by_shape": {s.value: n for s, n in pipeline.steps_by_shape.items()}}  # fmt: skip


def _adapters(requests: Iterable[Request]) -> list[str]:
    """The distinct LoRA adapters of these requests, in the order first seen."""
    return list(dict.fromkeys(r.lora for r in requests if r.lora is not None))
