"""The step loop: one thread owns the engine; asyncio handlers talk to it through queues.

The engine is not thread-safe, so every change to it (new requests, aborts) is a command that this
thread applies between steps. Outputs go back to each request's asyncio queue with
`call_soon_threadsafe` (`streams.py`); which requests may run is the run gate's (`run_gate.py`), forming the
world again the world keeper's (`recovery.py`), and what is told of the load the load report's
(`load_report.py`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from minedraft.api import generate_pb2
from minedraft.config import LoraModule
from minedraft.engine.engine import LLMEngine
from minedraft.engine.loras import LoraRefused
from minedraft.engine_client import EngineFailed, RequestFailed, Sink
from minedraft.metrics import Metrics
from minedraft.sampling.params import SamplingParams
from minedraft.scheduler.info import server_info
from minedraft.scheduler.load_report import LoadReport
from minedraft.scheduler.recovery import Recovery, WorldKeeper
from minedraft.scheduler.remote_executor import WorkerWorld, workers_answered
from minedraft.scheduler.run_gate import RunGate
from minedraft.scheduler.streams import RequestStreams
from minedraft.settings import SchedulerSettings

log = logging.getLogger("minedraft.scheduler")


@dataclass
class _Submit:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None
    sink: Sink
    lora: str | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _LoraUpdate:
    change: LoraModule | str  # an adapter to load, or the name of one to unload
    done: Callable[[LoraRefused | None], None]


class Draining(EngineFailed):
    """The scheduler is shutting down: no new requests (UNAVAILABLE, so clients retry elsewhere)."""


class EngineLoop:
    """Steps the engine; when a step fails, re-forms the world instead of failing requests:

    - the drafter died: a world without it goes on target-only at once, and takes the drafter back when it
      serves again (a new world, requests re-admitted, speculation resumes);
    - the verifier died: requests are held until a verifier serves again (at most `worker_wait_s`), then
      re-admitted; past that wait they fail with UNAVAILABLE, and the loop keeps trying for later ones.

    Re-admission re-prefills prompt + tokens so far, so no produced token changes. `on_state(serving,
    reason)` reports when the scheduler can or cannot serve.
    """

    def __init__(
        self,
        engine: LLMEngine,
        world: WorkerWorld,
        metrics: Metrics | None = None,
        on_state: Callable[[bool, str], None] | None = None,
        recovery: Recovery | None = None,
        stats_interval_s: float = 0.0,
        max_waiting: int | None = None,
    ) -> None:
        """`stats_interval_s`: seconds between stats log lines while requests run (0: none); `max_waiting`: the
        frontends' admission limit, as server_info tells it (None: the settings' default)."""
        self.engine = engine
        self.world = world  # the engine's executor, seen as the workers it can re-form into a new world
        self.metrics = metrics
        self.failed: str | None = None
        self.recovery = recovery or Recovery.of(SchedulerSettings())
        self.max_waiting = SchedulerSettings().max_waiting_requests if max_waiting is None else max_waiting
        self._on_state = on_state
        self._next_retry = 0.0
        self._commands: queue.Queue[_Submit | _Abort | _LoraUpdate | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stopped = False
        self.num_waiting = 0  # as of the last step (a metric; admission counts in the frontends)
        self.draining = False
        self.gate = RunGate(engine, self.recovery.seeded_wait_s)
        self.streams = RequestStreams(engine, metrics, on_finished=self.gate.left)
        self.keeper = WorldKeeper(engine, world, metrics, self.recovery, self.gate, on_formed=self._world_formed)
        self.load = LoadReport(engine, metrics, stats_interval_s)
        self._stalled = False  # the last step could not be planned
        self._was_busy = False  # requests were running when the last step ended (its successor's wait counts)
        self.speculation: dict | None = None  # the controller's state, refreshed once a second (EngineClient)
        self.lora_adapters = engine.lora_adapters  # replaced (never changed in place) when adapters change

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._commands.put(None)
        self._thread.join(timeout=30)

    # The EngineClient interface (engine_client.py), for the frontends.
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def kv_pool(self) -> tuple[int, int] | None:
        return self.engine.kv_pool

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.check_request(prompt_ids, params)  # reads only settings fixed at start: any thread may call

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, prompt: str | None, sink: Sink,
               lora: str | None = None, deadline: float | None = None) -> None:  # fmt: skip
        """`deadline` is not the step loop's: the frontend aborts a request whose client stopped waiting."""
        self._commands.put(_Submit(request_id, prompt_ids, params, prompt, sink, lora))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def server_info(self, timeout: float | None) -> generate_pb2.ServerInfo:
        """Read here, from settings fixed at start and the last second's speculation (no worker is asked)."""
        info = server_info(self.engine, self.max_waiting, self.speculation, self.lora_adapters)
        if self.world.pool is not None:
            info.drafter_pool.CopyFrom(self.world.pool.info(bound=self.engine.speculating))
        return info

    async def drafter_pools(self, timeout: float | None) -> dict[str, generate_pb2.DrafterPoolInfo | None]:
        info = await self.server_info(timeout)
        return {"": info.drafter_pool if info.HasField("drafter_pool") else None}

    async def load_lora(self, module: LoraModule) -> None:
        """Load an adapter on every worker (see `LLMEngine.load_lora`); raises LoraRefused."""
        await self._update_lora(module)

    async def unload_lora(self, name: str) -> None:
        """Unload one once no request runs through it (see `LLMEngine.unload_lora`); raises LoraRefused."""
        await self._update_lora(name)

    async def _update_lora(self, change: LoraModule | str) -> None:
        event_loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = event_loop.create_future()

        def settle(refused: LoraRefused | None) -> None:
            if not future.done():
                future.set_result(None) if refused is None else future.set_exception(refused)

        self._commands.put(_LoraUpdate(change, lambda refused: event_loop.call_soon_threadsafe(settle, refused)))
        await future

    def _run(self) -> None:
        while not self._stopped:
            # Stalled: the last step could not be planned (every request held or out of room): wait for a
            # command rather than spin.
            idle = self._stalled or not self.engine.has_unfinished() and not self.engine.in_flight
            if self.failed is not None:
                self._retry_after_failure()
            elif idle:
                self._safe(self.engine.flush)  # release the KV of finished/aborted requests now
                self.num_waiting = self.load.record_load()  # what is left (cancelled requests leave no step)
            if not self._apply_commands(block=idle or self.failed is not None):
                return
            if self.failed is None:
                self.keeper.watch_drafter()
            self.gate.release_waiting_seeds()
            self._settle_loras()
            if (self.engine.has_unfinished() or self.engine.in_flight) and self.failed is None:
                self._safe(self._step)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once stopped."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while command is not None:
            if isinstance(command, _Submit):
                self._add(command)
            elif isinstance(command, _LoraUpdate):
                self._change_lora(command)
            else:
                self._abort(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _change_lora(self, command: _LoraUpdate) -> None:
        def done(refused: LoraRefused | None) -> None:  # the frontends see the change before the reply
            self.lora_adapters = self.engine.lora_adapters
            command.done(refused)

        try:
            if isinstance(command.change, str):
                self.engine.unload_lora(command.change, done)
            else:
                self.engine.load_lora(command.change, done)
        except LoraRefused as exc:
            command.done(exc)
        self.lora_adapters = self.engine.lora_adapters

    def _settle_loras(self) -> None:
        """Unloads whose requests have finished complete; the frontends see the adapters served now."""
        self.engine.settle_loras()
        self.lora_adapters = self.engine.lora_adapters

    def drain(self, timeout_s: float) -> int:
        """Refuse new requests, let the running and queued ones finish for up to `timeout_s`, then stop
        the loop and fail what is left with UNAVAILABLE. Returns how many were cut off."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while (self.streams or not self._commands.empty()) and time.monotonic() < deadline and self.failed is None:
            time.sleep(0.05)
        self.stop()  # the loop thread has stopped: nobody else touches the streams now
        message = f"the server is shutting down and did not finish this request within {timeout_s:g}s"
        return len(self.streams.end_all(lambda: Draining(message)))

    def _add(self, command: _Submit) -> None:
        if self.draining:
            command.sink.put(Draining("the server is draining (shutting down): it accepts no new requests"))
            return
        if self.failed is not None:
            command.sink.put(EngineFailed(self.failed))
            return
        try:
            self.engine.add_request(command.prompt_ids, command.params, request_id=command.request_id,
                                    prompt=command.prompt, lora=command.lora)  # fmt: skip
        except ValueError as exc:  # SamplingParams' and the engine's bounds are the wire's: nothing else fails later
            command.sink.put(exc)
            return
        self.streams.open(command.request_id, command.sink)
        if not self.gate.may_run(command.request_id):
            self.engine.hold(command.request_id)  # a poison request search, or a seeded one waiting for a drafter

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self.streams.close(request_id)
        self.gate.left(request_id)

    def _step(self) -> None:
        """Keep the workers fed: plan and send steps until `max_in_flight` are out (the next plan travels
        while a step runs), then apply the oldest one's results and stream them."""
        engine = self.engine
        touched = engine.advance()
        self._stalled = touched is None
        if touched is None:
            return
        self.gate.ran(touched)
        self.streams.report_started()
        self.num_waiting = self.load.record_load()
        if self.world.pool is not None and engine.last_step is not None:
            self.world.pool.queue = engine.last_step.drafter_queue
        if self.metrics:
            self.metrics.record_step(engine.last_step, self._was_busy)
        if (speculation := self.load.speculation()) is not None:
            self.speculation = speculation
        was_busy, self._was_busy = self._was_busy, engine.has_unfinished()
        self.load.log_stats(self.streams.send(touched), was_busy)

    def _safe(self, fn) -> None:
        """A failed step leaves the workers out of lockstep (a peer may be waiting in a collective), so no
        later step of this world can be trusted: form a new one. If the workers answered with an error (they
        did not die), the requests of the failed world come under suspicion (see engine/quarantine.py)."""
        try:
            fn()
        except Exception as exc:
            log.warning("engine step failed (%s); re-forming the world", exc)
            if workers_answered(exc) and all(w.serving() for w in self.world.members):
                convicted = self.gate.blame()
                if convicted is not None:
                    self._convict(convicted, exc)
            self._recover(exc)

    def _convict(self, request_id: str, cause: BaseException) -> None:
        """Fail the one request that every failed step had in common; the others run on unchanged."""
        log.error("request %s quarantined: each engine step it took part in failed (last: %s); failing it alone",
                  request_id, cause)  # fmt: skip
        if self.metrics:
            self.metrics.quarantined_requests.inc()
        self.engine.abort_request(request_id)
        sink = self.streams.close(request_id)
        if sink is not None:
            sink.put(RequestFailed(f"the engine failed every step that ran this request, and no other request "
                                   f"made it fail; it was stopped so that the others can run (last error: {cause})"))
        self.engine.release_held(self.gate.may_run)

    def _recover(self, cause: BaseException) -> None:
        """Hold every request until a new world is formed, at most `worker_wait_s`."""
        deadline = time.monotonic() + self.recovery.worker_wait_s
        reason = f"re-forming the world after: {cause}"
        while not self._stopped:
            # NOT_SERVING only while no verifier serves: without its drafter the group decodes target-only.
            self._report(self.world.verifier.serving(), reason)
            if self.keeper.reform():
                return
            if time.monotonic() > deadline:
                address, wait = self.world.verifier.address, self.recovery.worker_wait_s
                self._fail_all(f"no verifier serves at {address}: requests were held {wait:.0f}s (--worker-wait) "
                               f"and then given up; the world failed with: {cause}")
                return
            if not self._apply_commands(block=False):
                return
            time.sleep(0.5)

    def _retry_after_failure(self) -> None:
        if time.monotonic() >= self._next_retry:
            self._next_retry = time.monotonic() + 1.0
            if self.keeper.reform():
                self.failed = None

    def _world_formed(self, mode: str) -> None:
        self._was_busy = False  # the wait for the first step of a new world is recovery, not a bubble
        self._report(True, mode)

    def _fail_all(self, reason: str) -> None:
        log.error("%s", reason)
        self.failed = reason
        for request_id in self.streams.end_all(lambda: EngineFailed(reason)):
            self.engine.abort_request(request_id)
        self._report(False, reason)

    def _report(self, serving: bool, reason: str) -> None:
        if self._on_state is not None:
            self._on_state(serving and not self.draining, reason)  # a draining scheduler stays NOT_SERVING
