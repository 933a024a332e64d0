"""The gateway's routing: one request over the engine groups, with migration when its group fails.

A request is sent to the group its routing policy picks (`policies.py`; by default the one with the least
outstanding work, `pool.py`). When that group fails
mid-request (UNAVAILABLE: its scheduler died or lost its verifier for good), it is submitted again to
another group as prompt + the tokens already streamed, with the remaining max_tokens and the same seed.
Both public protocols route through `Router`, by way of the gateway's engine client (`routed_engine.py`).

Text is derived here, from token ids, by the engine's own `Request` (detokenizer and stop strings) run
over the whole sequence: a multi-byte character cut at the seam, or a stop string spanning it, comes
out exactly as one group would have produced it. The groups' own text is not used.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minedraft.api import generate_pb2
from minedraft.client.resume import resume_request
from minedraft.engine.request import Request
from minedraft.gateway.policies import LeastWork
from minedraft.gateway.pool import Backend, NoBackend, Pool
from minedraft.model.tokenizer import Tokenizer
from minedraft.sampling.params import SamplingParams
from minedraft.wire import FINISH_REASONS, finish_reason_from_proto, sampling_to_proto, stats_from_proto, stats_to_proto

log = logging.getLogger("minedraft.gateway")

_RETRY_PAUSE_S = 0.05  # between attempts on a group that failed before it was seen NOT_SERVING


def _nothing() -> None:
    pass


class Migration:
    """What the gateway knows of one request: the original prompt, a mirror of its output, its seed, its
    LoRA adapter (every submission runs through the same one)."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer,
                 session: str | None = None, lora: str | None = None) -> None:  # fmt: skip
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.lora = lora
        self.session = session  # the client's x-session-id, for the policies that keep a session on one group
        # One seed for every submission: the random stream is keyed by (seed, position), so a resubmission
        # continues it where the dead group left off.
        self.params = params if params.seed is not None else params.model_copy(update={"seed": random.getrandbits(63)})
        # The group clips max_tokens to its max_model_len and says so (finish_reason length).
        self.mirror = Request.create(
            request_id, prompt_ids, self.params, seed=self.params.seed, tokenizer=tokenizer,
            max_model_len=len(prompt_ids) + self.params.max_tokens + 1, eos_token_ids=frozenset(),
        )  # fmt: skip
        self.sent_tokens = 0  # output tokens already streamed to the client

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.mirror.output_ids)

    def submission(self) -> generate_pb2.GenerateRequest:
        """Prompt + tokens so far (`resume_request`), the remaining max_tokens, the pinned seed."""
        original = generate_pb2.GenerateRequest(request_id=self.request_id, sampling=sampling_to_proto(self.params),
                                                lora_adapter=self.lora or "")  # fmt: skip
        return resume_request(original, self.prompt_ids, self.mirror.output_ids)

    def take(self, reply: generate_pb2.GenerateResponse) -> generate_pb2.GenerateResponse | None:
        """Apply one message of a group; return the message for the client (None when it has nothing new)."""
        if self.mirror.finished:  # a stop the group did not see (it spans the seam): the rest is dropped
            return None
        self.mirror.append_tokens(list(reply.token_ids))
        if reply.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            self.mirror.stats.merge(stats_from_proto(reply.spec_decode_stats))
            if reply.usage.HasField("accepted_prediction_tokens"):  # the group counted over the whole output
                self.mirror.prediction_usage = (reply.usage.accepted_prediction_tokens,
                                                reply.usage.rejected_prediction_tokens)  # fmt: skip
            self.mirror.finish_as(finish_reason_from_proto(reply.finish_reason))
        new_ids = self.mirror.output_ids[self.sent_tokens :]  # the mirror drops tokens after a stop
        prompt_logprobs = list(reply.prompt_logprobs) if self.sent_tokens == 0 else []
        self.sent_tokens = len(self.mirror.output_ids)
        text = self.mirror.take_stream_delta()
        if not (new_ids or text or self.mirror.finished):
            return None
        response = generate_pb2.GenerateResponse(request_id=self.request_id, text=text, token_ids=new_ids,
                                                 logprobs=list(reply.logprobs)[: len(new_ids)],
                                                 prompt_logprobs=prompt_logprobs)  # fmt: skip
        if self.mirror.finished:
            response.finish_reason = FINISH_REASONS.get(self.mirror.finish_reason, generate_pb2.FINISH_REASON_STOP)
            response.usage.prompt_tokens = len(self.prompt_ids)
            response.usage.completion_tokens = len(self.mirror.output_ids)
            if self.mirror.prediction_usage is not None:
                accepted, rejected = self.mirror.prediction_usage
                response.usage.accepted_prediction_tokens = accepted
                response.usage.rejected_prediction_tokens = rejected
            response.spec_decode_stats.CopyFrom(stats_to_proto(self.mirror.stats))
        return response


class Refused(Exception):
    """The request ends here with this status: a group refused it, or no group could take it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class GatewayMetrics(Collector):
    """The gateway's Prometheus metrics (on its HTTP API's /metrics): the groups as it sees them, read from
    the pool at each scrape, and the requests it resubmitted after their group failed."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.registry = CollectorRegistry()
        self.resubmissions = Counter(
            "minedraft:gateway_resubmissions", "Requests resubmitted to another engine group after theirs failed "
            "mid-request", registry=self.registry,
        )  # fmt: skip
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        serving = GaugeMetricFamily("minedraft:gateway_serving_groups", "Engine groups that serve now")
        serving.add_metric([], len(self.pool.serving_addresses()))
        in_flight = GaugeMetricFamily(
            "minedraft:gateway_requests_in_flight",
            "Requests this gateway has open on each engine group",
            labels=["group"],
        )
        for backend in self.pool.backends.values():
            in_flight.add_metric([backend.address], backend.requests)
        return iter((serving, in_flight))


class Router:
    """Runs one request over the engine groups, for both public protocols: placed on the group its policy
    picks; resubmitted to another when its group fails mid-way, until it is finished."""

    def __init__(self, pool: Pool, placement_timeout_s: float, metrics: GatewayMetrics | None = None,
                 policy: LeastWork | None = None) -> None:  # fmt: skip
        self.pool = pool
        self.placement_timeout_s = placement_timeout_s
        self.metrics = metrics
        self.policy = policy or LeastWork()

    async def run(
        self, migration: Migration, time_remaining: Callable[[], float | None], on_placed: Callable[[], None] = _nothing
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The client's messages; raises Refused. `time_remaining`: the client's deadline (None: none)."""
        avoid: set[str] = set()
        full: set[str] = set()  # groups that refused it for a full queue
        while not migration.mirror.finished:
            try:
                backend = await self._place(migration, self._placement_deadline(time_remaining()), avoid | full)
            except NoBackend as exc:
                message = f"{exc}; request {migration.request_id} not placed"
                raise Refused(grpc.StatusCode.UNAVAILABLE, message) from None
            on_placed()
            try:
                async for response in self._attempt(backend, migration, time_remaining()):
                    yield response
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    full.add(backend.address)
                    if self.pool.serving_addresses() <= full:  # every group is full: the client backs off
                        raise Refused(exc.code(), exc.details()) from None
                    continue
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise Refused(exc.code(), exc.details()) from None
                avoid = {backend.address}
                self._note_failure(migration, backend, exc)
                if self.metrics is not None:
                    self.metrics.resubmissions.inc()
                await asyncio.sleep(_RETRY_PAUSE_S)

    async def _place(self, migration: Migration, deadline: float, avoid: set[str]) -> Backend:
        """The group for the request's (rest of) tokens, by policy; the policy learns where it went."""
        ids = migration.prompt_ids + migration.mirror.output_ids
        request = self.policy.placement(ids, migration.remaining, migration.session, migration.lora)
        backend = await self.pool.acquire(deadline, avoid, migration.remaining,
                                          lambda backends: self.policy.choose(backends, request))  # fmt: skip
        self.policy.placed(backend, request)
        return backend

    def _placement_deadline(self, remaining: float | None) -> float:
        """Until when (time.monotonic()) a request may wait for a serving group, at each placement: a little
        before the client's deadline (which would turn UNAVAILABLE into DEADLINE_EXCEEDED), else
        --placement-timeout."""
        wait = self.placement_timeout_s if remaining is None else remaining - min(0.5, remaining / 10)
        return time.monotonic() + wait

    async def _attempt(self, backend: Backend, migration: Migration, timeout: float | None) -> AsyncIterator:
        """One submission to one group, for the client's remaining time (none: no deadline)."""
        owed = migration.remaining
        call = backend.stub.Generate(migration.submission(), timeout=timeout, metadata=self.pool.access.metadata)
        try:
            async for reply in call:
                response = migration.take(reply)
                backend.tokens -= len(reply.token_ids)
                owed -= len(reply.token_ids)
                if response is not None:
                    yield response
                if migration.mirror.finished:
                    return
            if not migration.mirror.finished:  # the stream ended without a finish: the group went away
                raise _ended_early(backend)
        finally:
            call.cancel()  # a no-op once finished; frees the group's KV when the client went away
            Pool.release(backend, owed)

    @staticmethod
    def _note_failure(migration: Migration, backend: Backend, exc: grpc.aio.AioRpcError) -> None:
        log.warning(
            "request %s: group %s failed (%s: %s) after %d output tokens; resubmitting to another group",
            migration.request_id, backend.address, exc.code().name, exc.details(), len(migration.mirror.output_ids),
        )  # fmt: skip

    async def server_info(self, timeout: float | None) -> generate_pb2.ServerInfo:
        """The info of a serving group (every group of a release runs the same engine config)."""
        backend = self.pool.pick(set())
        if backend is None:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "no engine group is serving")
        try:
            return await backend.stub.GetServerInfo(
                generate_pb2.GetServerInfoRequest(), timeout=timeout or 10, metadata=self.pool.access.metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise Refused(exc.code(), exc.details()) from None

    async def drafter_pools(self, timeout: float | None) -> dict[str, generate_pb2.DrafterPoolInfo | None]:
        """Every serving group's drafter pool binding, by its address (a group that does not answer is left out)."""
        backends = [b for b in self.pool.backends.values() if b.serving]
        calls = [b.stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=timeout or 10,
                                      metadata=self.pool.access.metadata) for b in backends]  # fmt: skip
        infos = await asyncio.gather(*calls, return_exceptions=True)
        return {b.address: info.drafter_pool if info.HasField("drafter_pool") else None
                for b, info in zip(backends, infos) if not isinstance(info, BaseException)}  # fmt: skip


def _ended_early(backend: Backend) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
        details=f"the stream from {backend.address} ended before the request finished",
    )  # fmt: skip
