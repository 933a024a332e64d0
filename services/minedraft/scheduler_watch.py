"""When a worker drops every request's state: its scheduler is gone.

The scheduler is the only source of truth for requests; a worker's per-request state (KV slots, draft
windows) is a cache that the scheduler which admitted it can use. Two signs that this scheduler is
gone: a plan from another scheduler incarnation (a restarted scheduler sends a new ``scheduler_id``),
or no plan at all for ``idle_reset_s`` seconds (a scheduler with running requests steps without
pause). Drafter and verifier receive the same plans, so they drop the same state at the same plan.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("minedraft.worker")


class SchedulerWatch:
    """Tracks the scheduler incarnation and the time since the last plan; not thread-safe by itself
    (the worker calls it under its step lock)."""

    def __init__(self, idle_reset_s: float | None) -> None:
        self.idle_reset_s = idle_reset_s if idle_reset_s else None  # 0 / None: no silence reset
        self.scheduler_id: str | None = None
        self._last_plan = time.monotonic()

    def on_plan(self, scheduler_id: str) -> str | None:
        """Record a plan's arrival; the reason to drop all state first, or None."""
        reason = None
        if scheduler_id and self.scheduler_id is not None and scheduler_id != self.scheduler_id:
            reason = f"a new scheduler ({scheduler_id}) replaced {self.scheduler_id}"
        elif self.silent_for() > (self.idle_reset_s or float("inf")):
            reason = f"no plan for {self.silent_for():.0f}s"
        self.scheduler_id = scheduler_id or self.scheduler_id
        return reason

    def step_done(self) -> None:
        self._last_plan = time.monotonic()

    def silent_for(self) -> float:
        return time.monotonic() - self._last_plan

    def idle_expired(self) -> bool:
        return self.idle_reset_s is not None and self.silent_for() > self.idle_reset_s


def watch_idle(watch: SchedulerWatch, lock: threading.Lock, drop_all: Callable[[str], None]) -> threading.Thread:
    """A daemon thread that drops all state once the scheduler has been silent too long (between
    steps only: it takes the step lock)."""

    def loop() -> None:
        assert watch.idle_reset_s is not None
        while True:
            time.sleep(min(5.0, watch.idle_reset_s / 4))
            with lock:
                if watch.idle_expired():
                    drop_all(f"no plan for {watch.silent_for():.0f}s")
                    watch.step_done()  # one reset per silence

    thread = threading.Thread(target=loop, name="idle-reset", daemon=True)
    thread.start()
    return thread
