"""The streams of the requests the step loop runs: each one's sink (its frontend's queue), how many of its tokens
went out, and whether it has been told that it left the waiting queue."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from minedraft.engine.engine import LLMEngine
from minedraft.engine.request import Request, RequestStatus
from minedraft.engine_client import RequestFailed, Sink, StreamItem, send_all
from minedraft.metrics import Metrics


class RequestStreams:
    """The sink of every request in the engine. Only the step loop's thread touches them (and `drain`, once that
    thread has stopped). `on_finished(request_id)`: a request finished and left the engine."""

    def __init__(self, engine: LLMEngine, metrics: Metrics | None, on_finished: Callable[[str], None]) -> None:
        self.engine = engine
        self.metrics = metrics
        self._on_finished = on_finished
        self._sinks: dict[str, Sink] = {}
        self._unstarted: set[str] = set()  # requests whose sink has not been told that they left the queue

    def __len__(self) -> int:
        return len(self._sinks)

    def open(self, request_id: str, sink: Sink) -> None:
        self._sinks[request_id] = sink
        self._unstarted.add(request_id)

    def close(self, request_id: str) -> Sink | None:
        """Stop streaming a request (aborted, or failed alone); its sink, if it had one."""
        self._unstarted.discard(request_id)
        return self._sinks.pop(request_id, None)

    def end_all(self, error: Callable[[], BaseException]) -> list[str]:
        """Give every open stream an `error()` of its own and close it; the requests' ids."""
        ended = list(self._sinks)
        for sink in self._sinks.values():
            sink.put(error())
        self._sinks.clear()
        self._unstarted.clear()
        return ended

    def report_started(self) -> None:
        """Tell the frontends which requests left the waiting queue (they count waiting requests)."""
        for request_id in list(self._unstarted):
            request = self.engine.requests.get(request_id)
            if request is None or request.status is not RequestStatus.WAITING:
                self._unstarted.discard(request_id)
                sink = self._sinks.get(request_id)
                if sink is not None:
                    sink.started()

    def send(self, touched: Iterable[Request]) -> int:
        """Stream what a step gave these requests, with one wake-up of each event loop; the tokens sent."""
        outbox = []
        for request in touched:
            sink = self._sinks.get(request.request_id)
            item = self._deliver(request, sink) if sink is not None else None
            if item is not None:
                outbox.append((sink, item))
        send_all(outbox)
        return sum(len(item.token_ids) for _, item in outbox if isinstance(item, StreamItem))

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
            self._on_finished(request.request_id)
            if self.metrics:
                self.metrics.record_finished(request)
        if request.error is not None:
            return RequestFailed(f"request {request.request_id} failed: {request.error}")
        if text or new_ids or request.finished:
            return StreamItem(text, new_ids, request if request.finished else None, logprobs, prompt_logprobs)
        return None
