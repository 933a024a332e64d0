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
from collections.abc import Callable
from dataclasses import dataclass, field

from minedraft.config import num_slots
from minedraft.engine.engine import LLMEngine
from minedraft.engine.request import Request
from minedraft.metrics import Metrics
from minedraft.sampling.params import SamplingParams

log = logging.getLogger("minedraft.scheduler")


@dataclass
class StreamItem:
    """New output of one request since the previous item; `request` is set on the last one."""

    text: str
    token_ids: list[int]
    finished: Request | None = None


@dataclass
class Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent_tokens: int = 0

    def put(self, item: StreamItem | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Submit:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None
    sink: Sink


@dataclass
class _Abort:
    request_id: str


class EngineFailed(RuntimeError):
    """The engine group is broken; requests fail with UNAVAILABLE until it is restarted."""


class Draining(EngineFailed):
    """The scheduler is shutting down: no new requests (UNAVAILABLE, so clients retry elsewhere)."""


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        metrics: Metrics | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.failed: str | None = None
        self._on_failure = on_failure
        self._commands: queue.Queue[_Submit | _Abort | None] = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stopped = False
        self.draining = False
        self.num_waiting = 0  # read by handlers for admission control (an int: safe to read across threads)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._commands.put(None)
        self._thread.join(timeout=30)

    @property
    def queued(self) -> int:
        """Requests accepted but not yet running."""
        return self.num_waiting + self._commands.qsize()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, prompt: str | None, sink: Sink):
        self._commands.put(_Submit(request_id, prompt_ids, params, prompt, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def _run(self) -> None:
        while not self._stopped:
            idle = not self.engine.has_unfinished()
            if idle:
                self._safe(self.engine.executor.flush)  # release the KV of finished/aborted requests now
                self._record_load()
            if not self._apply_commands(block=idle):
                return
            if self.engine.has_unfinished():
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
            else:
                self._abort(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

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
            self.engine.add_request(
                command.prompt_ids, command.params, request_id=command.request_id, prompt=command.prompt
            )
        except ValueError as exc:
            command.sink.put(exc)
            return
        self._sinks[command.request_id] = command.sink

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._sinks.pop(request_id, None)

    def _step(self) -> None:
        touched = self.engine.step()
        batches = self.engine.pipeline.batches
        self.num_waiting = len(batches.waiting)
        if self.metrics and self.engine.last_step is not None:
            self.metrics.record_step(self.engine.last_step, self.num_waiting, batches.num_running, self._num_slots)
        for request in touched:
            sink = self._sinks.get(request.request_id)
            if sink is None:
                continue
            new_ids = request.output_ids[sink.sent_tokens :]
            sink.sent_tokens = len(request.output_ids)
            if self.metrics:
                self.metrics.generation_tokens.inc(len(new_ids))
            text = request.take_stream_delta()
            if request.finished:
                del self._sinks[request.request_id]
                if self.metrics:
                    self.metrics.record_finished(request)
            if text or new_ids or request.finished:
                sink.put(StreamItem(text, new_ids, request if request.finished else None))

    @property
    def _num_slots(self) -> int:
        return num_slots(self.engine.config)

    def _record_load(self) -> None:
        if self.metrics is not None:
            batches = self.engine.pipeline.batches
            self.metrics.record_load(len(batches.waiting), batches.num_running, self._num_slots)

    def _safe(self, fn) -> None:
        """A failed step is fatal for the engine group: a worker died or the drafter and the verifier fell
        out of lockstep, so no later step could be trusted. Fail the requests in flight and every later
        one, and report it (the service turns NOT_SERVING), instead of hanging on a dead peer."""
        if self.failed is not None:
            return
        try:
            fn()
        except Exception as exc:
            log.exception("engine step failed; the engine group must be restarted")
            self.failed = f"the engine failed and must be restarted: {exc}"
            for request_id, sink in list(self._sinks.items()):
                sink.put(EngineFailed(self.failed))
                self.engine.abort_request(request_id)
            self._sinks.clear()
            if self._on_failure is not None:
                self._on_failure(self.failed)
