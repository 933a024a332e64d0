"""Forming the group's world again: after a failed step, to take its drafter back, to bind to a pool's member."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from grpc_health.v1 import health_pb2

from minedraft.engine.engine import LLMEngine
from minedraft.metrics import Metrics
from minedraft.scheduler.remote_executor import WorkerWorld
from minedraft.scheduler.run_gate import RunGate
from minedraft.settings import SchedulerSettings

log = logging.getLogger("minedraft.scheduler")


@dataclass
class Recovery:
    """How the loop re-forms its world after a failed step (see `EngineLoop._recover`)."""

    worker_wait_s: float  # how long requests are held while no verifier is back
    join_timeout_s: float  # how long forming a world may take
    seeded_wait_s: float = 60.0  # how long a seeded sampled request waits for a drafter (see `RunGate`)
    drafter_check_s: float = 1.0  # how often a world without its drafter looks for it
    max_worlds_per_minute: int = 20  # re-formations; past that the loop waits, never spins

    @classmethod
    def of(cls, settings: SchedulerSettings) -> Recovery:
        return cls(worker_wait_s=settings.worker_wait, join_timeout_s=settings.join_timeout,
                   seeded_wait_s=settings.seeded_drafter_wait)  # fmt: skip


class WorldKeeper:
    """Forms a new world of the live workers (the verifier is required) and re-admits every request that may
    run, at most `max_worlds_per_minute` times a minute; between steps it looks, in the background, for a
    drafter to take back or a pool's member to bind to. `on_formed(mode)`: a world was formed."""

    def __init__(self, engine: LLMEngine, world: WorkerWorld, metrics: Metrics | None, recovery: Recovery,
                 gate: RunGate, on_formed: Callable[[str], None]) -> None:  # fmt: skip
        self.engine = engine
        self.world = world  # the engine's executor, seen as the workers it can re-form into a new world
        self.metrics = metrics
        self.recovery = recovery
        self.gate = gate
        self._on_formed = on_formed
        self._formed_at: deque[float] = deque()  # when the recent worlds were formed (rate limit)
        self._limit_logged_at = 0.0
        self._probe: Future | None = None  # a check of the drafter in flight (never blocks the loop)
        self._next_probe = 0.0
        if metrics is not None and world.pool is not None:  # the binding the engine started with
            metrics.record_binding(world.drafter.address if world.has_drafter else None, world.pool.rebinds)

    def reform(self) -> bool:
        """Form a new world and re-admit every request that may run (during a search for a poison request, some
        wait outside; see engine/quarantine.py). False: not now (no verifier serves, or the rate limit)."""
        world = self.world
        if not self._may_form_world() or not world.verifier.serving():
            return False
        with_drafter = world.choose_drafter()
        self._formed_at.append(time.monotonic())
        try:
            world.form_world(self.engine.config, with_drafter, timeout_s=self.recovery.join_timeout_s)
        except Exception as exc:
            log.warning("could not form a world: %s", exc)
            return False
        self.gate.world_formed(world.has_drafter)
        self.engine.restart(speculate=world.has_drafter, may_run=self.gate.may_run)
        if self.metrics and world.pool is not None:
            self.metrics.record_binding(world.drafter.address if world.has_drafter else None, world.pool.rebinds)
        mode = "speculating" if self.engine.speculating else "target-only (no drafter)"
        log.info("world formed (epoch %d), %s; %d requests re-admitted", world.epoch, mode,
                 len(self.engine.requests))
        self._on_formed(mode)
        return True

    def _may_form_world(self) -> bool:
        """At most `max_worlds_per_minute` formations in any minute: a failure that keeps coming back is
        slowed down to that, never a tight loop."""
        now = time.monotonic()
        while self._formed_at and now - self._formed_at[0] > 60.0:
            self._formed_at.popleft()
        if len(self._formed_at) < self.recovery.max_worlds_per_minute:
            return True
        if now - self._limit_logged_at > 10.0:
            self._limit_logged_at = now
            log.warning("%d worlds formed in the last minute: waiting before the next",
                        len(self._formed_at))  # fmt: skip
        return False

    def watch_drafter(self) -> None:
        """Now and then, in the background (a hung drafter does not answer, and the loop must not wait for it):
        a world without its drafter checks whether it serves again, and takes it back. With a drafter pool: while
        drafting, whether the member stopped serving (it drains: move before it goes); while not, whether a
        member has room. Either way, bind again."""
        world = self.world
        if world.pool is not None:
            probe = self._finished_probe(lambda: world.probe_pool(self.engine.speculating))
            if probe is not None and probe.result():
                log.info("binding to the drafter pool again (%s)",
                         "the member stopped serving" if self.engine.speculating else "a member has room")  # fmt: skip
                self.reform()
        elif not self.engine.speculating and world.drafter is not None:
            probe = self._finished_probe(world.drafter.serving_later)
            if probe is not None and probe.result().status == health_pb2.HealthCheckResponse.SERVING:
                log.info("the drafter at %s serves again: taking it back", world.drafter.address)
                self.reform()

    def _finished_probe(self, start: Callable[[], Future]) -> Future | None:
        """The check that has just answered (None: none has, or it failed); starts the next one when due."""
        if self._probe is None:
            if time.monotonic() >= self._next_probe:
                self._probe = start()
            return None
        if not self._probe.done():
            return None
        probe, self._probe = self._probe, None
        self._next_probe = time.monotonic() + self.recovery.drafter_check_s
        return probe if probe.exception() is None else None
