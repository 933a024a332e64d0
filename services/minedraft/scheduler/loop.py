"""The step loop: one thread owns the engine; asyncio handlers talk to it through queues.

The engine is not thread-safe, so every change to it (new requests, aborts) is a command that this
thread applies between steps. Outputs go back to each request's asyncio queue with
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from grpc_health.v1 import health_pb2

from minedraft.api import generate_pb2
from minedraft.config import LoraModule
from minedraft.engine.adaptive import seeded_sampling
from minedraft.engine.engine import LLMEngine
from minedraft.engine.loras import LoraRefused
from minedraft.engine.quarantine import Quarantine
from minedraft.engine.request import Request, RequestStatus
from minedraft.engine_client import EngineFailed, RequestFailed, Sink, StreamItem, send_all
from minedraft.metrics import Metrics
from minedraft.sampling.params import SamplingParams
from minedraft.scheduler.info import server_info
from minedraft.scheduler.remote_executor import WorkerWorld, workers_answered
from minedraft.scheduler.stats_log import StatsLog
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


@dataclass
class Recovery:
    """How the loop re-forms its world after a failed step (see `EngineLoop._recover`)."""

    worker_wait_s: float  # how long requests are held while no verifier is back
    join_timeout_s: float  # how long forming a world may take
    seeded_wait_s: float = 60.0  # how long a seeded sampled request waits for a drafter (see `_may_run`)
    drafter_check_s: float = 1.0  # how often a world without its drafter looks for it
    max_worlds_per_minute: int = 20  # re-formations; past that the loop waits, never spins

    @classmethod
    def of(cls, settings: SchedulerSettings) -> Recovery:
        return cls(worker_wait_s=settings.worker_wait, join_timeout_s=settings.join_timeout,
                   seeded_wait_s=settings.seeded_drafter_wait)  # fmt: skip


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
        self._next_drafter_check = 0.0
        self._drafter_probe = None  # a health check of the absent drafter in flight (never blocks the loop)
        self._next_retry = 0.0
        self._commands: queue.Queue[_Submit | _Abort | _LoraUpdate | None] = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._unstarted: set[str] = set()  # requests whose sink has not been told that they left the queue
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stopped = False
        self._preemptions_seen = 0
        self.num_waiting = 0  # as of the last step (a metric; admission counts in the frontends)
        self.draining = False
        self.quarantine = Quarantine()
        self.stats_log = StatsLog(stats_interval_s)
        self._stalled = False  # the last step could not be planned
        self._was_busy = False  # requests were running when the last step ended (its successor's wait counts)
        self._formed_at: deque[float] = deque()  # when the recent worlds were formed (rate limit)
        self._limit_logged_at = 0.0
        self.speculation: dict | None = None  # the controller's state, refreshed once a second (EngineClient)
        self.lora_adapters = engine.lora_adapters  # replaced (never changed in place) when adapters change
        self._speculation_at = 0.0
        # Since when the group decodes target-only although it has a speculative config (None: it drafts).
        self._target_only_since = None if engine.speculating or engine.config.speculative_config is None else (
            time.monotonic())  # fmt: skip
        if metrics is not None and world.pool is not None:  # the binding the engine started with
            metrics.record_binding(world.drafter.address if world.has_drafter else None, world.pool.rebinds)

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
                self._record_load()  # the gauges go back to what is left (cancelled requests leave no step)
            if not self._apply_commands(block=idle or self.failed is not None):
                return
            self._take_drafter_back()
            self._release_waiting_seeds()
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
        while self._busy() and time.monotonic() < deadline and self.failed is None:
            time.sleep(0.05)
        self.stop()
        left = list(self._sinks.values())  # the loop thread has stopped: nobody else touches them now
        for sink in left:
            sink.put(Draining(f"the server is shutting down and did not finish this request within {timeout_s:g}s"))
        self._sinks.clear()
        return len(left)

    def _busy(self) -> bool:
        return bool(self._sinks) or not self._commands.empty()

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
        self._sinks[command.request_id] = command.sink
        self._unstarted.add(command.request_id)
        if not self._may_run(command.request_id):
            self.engine.hold(command.request_id)  # a poison request search, or a seeded one waiting for a drafter

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._sinks.pop(request_id, None)
        self._unstarted.discard(request_id)
        self._left(request_id)

    def _left(self, request_id: str) -> None:
        """A request left the engine: a search for a poison request may now let held requests in."""
        if self.quarantine.forget(request_id):
            self.engine.release_held(self._may_run)

    def _report_started(self) -> None:
        """Tell the frontends which requests left the waiting queue (they count waiting requests)."""
        for request_id in list(self._unstarted):
            request = self.engine.requests.get(request_id)
            if request is None or request.status is not RequestStatus.WAITING:
                self._unstarted.discard(request_id)
                sink = self._sinks.get(request_id)
                if sink is not None:
                    sink.started()

    def _step(self) -> None:
        """Keep the workers fed: plan and send steps until `max_in_flight` are out (the next plan travels
        while a step runs), then apply the oldest one's results and stream them."""
        engine = self.engine
        touched = engine.advance()
        self._stalled = touched is None
        if touched is None:
            return
        if self.quarantine.searching and self.quarantine.ran(r.request_id for r in touched):
            engine.release_held(self._may_run)
        if self._unstarted:
            self._report_started()
        self._record_load()
        if self.world.pool is not None and engine.last_step is not None:
            self.world.pool.queue = engine.last_step.drafter_queue
        if self.metrics:
            self.metrics.record_step(engine.last_step, self._was_busy)
        self._note_speculation()
        was_busy, self._was_busy = self._was_busy, engine.has_unfinished()
        outbox = []
        for request in touched:
            sink = self._sinks.get(request.request_id)
            item = self._deliver(request, sink) if sink is not None else None
            if item is not None:
                outbox.append((sink, item))
        send_all(outbox)
        self._log_stats(sum(len(item.token_ids) for _, item in outbox if isinstance(item, StreamItem)), was_busy)

    def _note_speculation(self) -> None:
        """A snapshot of the controller for the frontends' threads, at most once a second (it solves the fits)."""
        now = time.monotonic()
        pipeline = self.engine.pipeline
        if pipeline.controller is None or now - self._speculation_at < 1.0:
            return
        self._speculation_at = now
        self.speculation = {**pipeline.controller.describe(),
                            "steps_by_shape": {s.value: n for s, n in pipeline.steps_by_shape.items()}}

    def _log_stats(self, generated_tokens: int, was_busy: bool) -> None:
        self.stats_log.record(self.engine.last_step, generated_tokens, was_busy)
        batches = self.engine.pipeline.batches
        kv_usage = batches.used_blocks / batches.budget.num_blocks if batches.budget is not None else None
        line = self.stats_log.line(batches.num_running, len(batches.waiting), kv_usage)
        if line is not None:
            log.info("%s", line)

    def _deliver(self, request: Request, sink: Sink) -> StreamItem | RequestFailed | None:
        """A request's new tokens and text, for its stream; a failure here is this request's alone."""
        try:
            new_ids = request.output_ids[sink.sent_tokens :]
            prompt_logprobs = request.prompt_logprobs if sink.sent_tokens == 0 and new_ids else None
            logprobs = None if request.logprobs is None else request.logprobs[sink.sent_tokens :]
            sink.sent_tokens = len(request.output_ids)
            text = request.take_stream_delta()
        except Exception as exc:
            request.fail(f"streaming its output failed: {type(exc).__name__}: {exc}")
            self.engine.abort_request(request.request_id)
            new_ids, text, logprobs, prompt_logprobs = [], "", None, None
        if self.metrics and new_ids:
            self.metrics.generation_tokens.inc(len(new_ids))
            now = time.monotonic()
            self.metrics.record_output(request, None if sink.last_output_at is None else now - sink.last_output_at)
            sink.last_output_at = now
        if request.finished:
            del self._sinks[request.request_id]
            self._left(request.request_id)
            if self.metrics:
                self.metrics.record_finished(request)
        if request.error is not None:
            return RequestFailed(f"request {request.request_id} failed: {request.error}")
        if text or new_ids or request.finished:
            return StreamItem(text, new_ids, request if request.finished else None, logprobs, prompt_logprobs)
        return None

    def _record_load(self) -> None:
        """Requests waiting and running, KV usage and preemptions, as the engine holds them now."""
        batches = self.engine.pipeline.batches
        self.num_waiting = len(batches.waiting)
        if self.metrics is None:
            return
        self.metrics.waiting.set(self.num_waiting)
        self.metrics.running.set(batches.num_running)
        if batches.budget is not None:
            self.metrics.kv_usage.set(batches.used_blocks / batches.budget.num_blocks)
            self.metrics.record_cache_config(batches.budget.num_blocks, batches.budget.block_size)
        self.metrics.preemptions.inc(self.engine.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = self.engine.num_preemptions
        if self.engine.config.enable_lora:
            running = (r for batch in batches.batches for r in batch)
            self.metrics.record_lora(_adapters(running), _adapters(batches.waiting), self.engine.config.max_loras)

    def _safe(self, fn) -> None:
        """A failed step leaves the workers out of lockstep (a peer may be waiting in a collective), so no
        later step of this world can be trusted: form a new one. If the workers answered with an error (they
        did not die), the requests of the failed world come under suspicion (see engine/quarantine.py)."""
        try:
            fn()
        except Exception as exc:
            log.warning("engine step failed (%s); re-forming the world", exc)
            if workers_answered(exc) and all(w.serving() for w in self.world.members):
                self._blame(exc)
            self._recover(exc)

    def _blame(self, cause: BaseException) -> None:
        convicted = self.quarantine.failed(self.engine.running_ids())
        if self.quarantine.searching:
            log.warning("looking for a request that fails every step: %d suspects, %d under test",
                        len(self.quarantine.suspects), len(self.quarantine.testing))  # fmt: skip
        if convicted is not None:
            self._convict(convicted, cause)

    def _convict(self, request_id: str, cause: BaseException) -> None:
        """Fail the one request that every failed step had in common; the others run on unchanged."""
        log.error("request %s quarantined: each engine step it took part in failed (last: %s); failing it alone",
                  request_id, cause)  # fmt: skip
        if self.metrics:
            self.metrics.quarantined_requests.inc()
        self.engine.abort_request(request_id)
        self._unstarted.discard(request_id)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.put(RequestFailed(f"the engine failed every step that ran this request, and no other request "
                                   f"made it fail; it was stopped so that the others can run (last error: {cause})"))
        self.engine.release_held(self._may_run)

    def _recover(self, cause: BaseException) -> None:
        """Hold every request until a new world is formed, at most `worker_wait_s`."""
        deadline = time.monotonic() + self.recovery.worker_wait_s
        reason = f"re-forming the world after: {cause}"
        while not self._stopped:
            # NOT_SERVING only while no verifier serves: without its drafter the group decodes target-only.
            self._report(self.world.verifier.serving(), reason)
            if self._reform():
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
            if self._reform():
                self.failed = None

    def _reform(self) -> bool:
        """Form a new world of the live workers (the verifier is required) and re-admit every request that
        may run (during a search for a poison request, some wait outside; see engine/quarantine.py)."""
        world = self.world
        if not self._may_form_world() or not world.verifier.serving():
            return False
        with_drafter = world.choose_drafter()
        self._formed_at.append(time.monotonic())
        try:
            world.form_world(self.engine.config, with_drafter, timeout_s=self.recovery.join_timeout_s)
        except Exception as exc:
            if not (with_drafter and world.pool is not None) or not self._form_without_drafter(exc):
                log.warning("could not form a world: %s", exc)
                return False
        if world.has_drafter or self.engine.config.speculative_config is None:
            self._target_only_since = None
        elif self._target_only_since is None:  # the outage goes on across re-formations without a drafter
            self._target_only_since = time.monotonic()
        self.engine.restart(speculate=world.has_drafter, may_run=self._may_run)
        self._was_busy = False  # the wait for the first step of a new world is recovery, not a bubble
        if self.metrics and world.pool is not None:
            self.metrics.record_binding(world.drafter.address if world.has_drafter else None, world.pool.rebinds)
        mode = "speculating" if self.engine.speculating else "target-only (no drafter)"
        log.info("world formed (epoch %d), %s; %d requests re-admitted", world.epoch, mode,
                 len(self.engine.requests))
        self._report(True, mode)
        return True

    def _form_without_drafter(self, cause: BaseException) -> bool:
        """A pool drafter that could not take the group (it filled up, or died since it was chosen): the group
        decodes target-only meanwhile rather than wait."""
        log.warning("the pool drafter at %s could not take this group (%s): target-only until one can",
                    self.world.drafter.address if self.world.drafter else "?", cause)  # fmt: skip
        try:
            self.world.form_world(self.engine.config, False, timeout_s=self.recovery.join_timeout_s)
        except Exception as exc:
            log.warning("could not form a world without the drafter either: %s", exc)
            return False
        return True

    def _may_run(self, request_id: str) -> bool:
        """Whether a request may run in the world now: not while a search for a poison request keeps it out
        (engine/quarantine.py), nor, for a seeded sampled request, while the group decodes target-only, for at most
        `seeded_wait_s` of it: its text depends on where its windows fall, and a stretch decoded without windows
        would give another sample than a run with its drafter (docs/services.md)."""
        if not self.quarantine.may_run(request_id):
            return False
        request = self.engine.requests.get(request_id)
        return (self._target_only_since is None or request is None or not seeded_sampling(request)
                or time.monotonic() - self._target_only_since >= self.recovery.seeded_wait_s)  # fmt: skip

    def _release_waiting_seeds(self) -> None:
        """Past the wait, the seeded requests held for a drafter decode target-only."""
        if (self._target_only_since is not None and self.engine.held
                and time.monotonic() - self._target_only_since >= self.recovery.seeded_wait_s):  # fmt: skip
            self.engine.release_held(self._may_run)

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

    def _take_drafter_back(self) -> None:
        """A world without its drafter checks now and then whether it serves again. The check runs
        in the background: a hung drafter does not answer, and the loop must not wait for it."""
        world = self.world
        if self.failed is None and world.pool is not None:
            self._watch_pool()
            return
        if self.failed is not None or self.engine.speculating or world.drafter is None:
            return
        if self._drafter_probe is None:
            if time.monotonic() >= self._next_drafter_check:
                self._drafter_probe = world.drafter.serving_later()
            return
        if not self._drafter_probe.done():
            return
        probe, self._drafter_probe = self._drafter_probe, None
        self._next_drafter_check = time.monotonic() + self.recovery.drafter_check_s
        if probe.exception() is None and probe.result().status == health_pb2.HealthCheckResponse.SERVING:
            log.info("the drafter at %s serves again: taking it back", world.drafter.address)
            self._reform()

    def _watch_pool(self) -> None:
        """With a drafter pool, now and then in the background: while drafting, whether the member stopped serving
        (it drains: move before it goes); while not, whether a member has room. Either way, bind again."""
        if self._drafter_probe is None:
            if time.monotonic() >= self._next_drafter_check:
                self._drafter_probe = self.world.probe_pool(self.engine.speculating)
            return
        if not self._drafter_probe.done():
            return
        probe, self._drafter_probe = self._drafter_probe, None
        self._next_drafter_check = time.monotonic() + self.recovery.drafter_check_s
        if probe.exception() is None and probe.result():
            log.info("binding to the drafter pool again (%s)",
                     "the member stopped serving" if self.engine.speculating else "a member has room")  # fmt: skip
            self._reform()

    def _fail_all(self, reason: str) -> None:
        log.error("%s", reason)
        self.failed = reason
        for request_id, sink in list(self._sinks.items()):
            sink.put(EngineFailed(reason))
            self.engine.abort_request(request_id)
        self._sinks.clear()
        self._unstarted.clear()
        self._report(False, reason)

    def _report(self, serving: bool, reason: str) -> None:
        if self._on_state is not None:
            self._on_state(serving and not self.draining, reason)  # a draining scheduler stays NOT_SERVING


def _adapters(requests: Iterable[Request]) -> list[str]:
    """The distinct LoRA adapters of these requests, in the order first seen."""
    return list(dict.fromkeys(r.lora for r in requests if r.lora is not None))
