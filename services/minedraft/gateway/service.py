"""`minedraft gateway`: the public MineDraft API in front of N engine groups, with request migration.

Stateless: a request lives here only while its stream is open. It is sent to the group with the least
outstanding work (`pool.py`). When that group fails mid-request (UNAVAILABLE: its scheduler died or lost
its verifier for good), the request is submitted again to another group as prompt + the tokens already
streamed, with the remaining max_tokens and the same seed, and the client's stream goes on.

Text is derived here, from token ids, by the engine's own `Request` (detokenizer and stop strings) run
over the whole sequence: a multi-byte character cut at the seam, or a stop string spanning it, comes
out exactly as one group would have produced it. The groups' own text is not used.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1.health import aio as health_aio

from minedraft.api import generate_pb2
from minedraft.engine.request import Request, SpecDecodeStats
from minedraft.gateway.pool import Backend, NoBackend, Pool
from minedraft.model.tokenizer import Tokenizer, load_tokenizer
from minedraft.sampling.params import SamplingParams
from minedraft.serving import parse_generate, parse_request, set_public_status, start_public_server
from minedraft.wire import (
    FINISH_REASONS,
    finish_reason_from_proto,
    sampling_to_proto,
    stats_from_proto,
    stats_to_proto,
)

log = logging.getLogger("minedraft.gateway")

_RETRY_PAUSE_S = 0.05  # between attempts on a group that failed before it was seen NOT_SERVING


class Migration:
    """What the gateway knows of one request: the original prompt, a mirror of its output, its seed."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        # One seed for every submission: the random stream is keyed by (seed, position), so a resubmission
        # continues it where the dead group left off.
        self.params = params if params.seed is not None else params.model_copy(update={"seed": random.getrandbits(63)})
        # The group clips max_tokens to its max_model_len and says so (finish_reason length).
        self.mirror = Request.create(
            request_id, prompt_ids, self.params, seed=self.params.seed, tokenizer=tokenizer,
            max_model_len=len(prompt_ids) + self.params.max_tokens + 1, eos_token_ids=frozenset(),
        )  # fmt: skip
        self.stats = SpecDecodeStats()
        self.sent_tokens = 0  # output tokens already streamed to the client

    @property
    def resumable(self) -> bool:
        """Whether another group can continue it. A grammar's matcher would start again at the seam (the
        output so far goes as prompt), so structured output that has begun cannot move."""
        return self.params.structured_outputs is None or not self.mirror.output_ids

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.mirror.output_ids)

    def submission(self) -> generate_pb2.GenerateRequest:
        """Prompt + tokens so far, the remaining max_tokens, the pinned seed."""
        produced = len(self.mirror.output_ids)
        params = self.params.model_copy(update={"max_tokens": self.remaining,
                                                "min_tokens": max(0, self.params.min_tokens - produced)})  # fmt: skip
        ids = self.prompt_ids + self.mirror.output_ids
        return generate_pb2.GenerateRequest(
            request_id=self.request_id, prompt_token_ids=generate_pb2.TokenIds(ids=ids),
            sampling=sampling_to_proto(params),
        )  # fmt: skip

    def take(self, reply: generate_pb2.GenerateResponse) -> generate_pb2.GenerateResponse | None:
        """Apply one message of a group; return the message for the client (None when it has nothing new)."""
        if self.mirror.finished:  # a stop the group did not see (it spans the seam): the rest is dropped
            return None
        self.mirror.append_tokens(list(reply.token_ids))
        if reply.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            self.stats.merge(stats_from_proto(reply.spec_decode_stats))
            self.mirror.finish_as(finish_reason_from_proto(reply.finish_reason))
        new_ids = self.mirror.output_ids[self.sent_tokens :]  # the mirror drops tokens after a stop
        self.sent_tokens = len(self.mirror.output_ids)
        text = self.mirror.take_stream_delta()
        if not (new_ids or text or self.mirror.finished):
            return None
        response = generate_pb2.GenerateResponse(request_id=self.request_id, text=text, token_ids=new_ids,
                                                 logprobs=list(reply.logprobs)[: len(new_ids)])  # fmt: skip
        if self.mirror.finished:
            response.finish_reason = FINISH_REASONS.get(self.mirror.finish_reason, generate_pb2.FINISH_REASON_STOP)
            response.usage.prompt_tokens = len(self.prompt_ids)
            response.usage.completion_tokens = len(self.mirror.output_ids)
            response.spec_decode_stats.CopyFrom(stats_to_proto(self.stats))
        return response


class GatewayServicer:
    def __init__(self, pool: Pool, tokenizer: Tokenizer, placement_timeout_s: float) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.placement_timeout_s = placement_timeout_s

    async def Generate(self, request_bytes: bytes, context: grpc.aio.ServicerContext):  # noqa: N802
        request, params = await parse_generate(request_bytes, context)
        if request.HasField("prompt_token_ids"):
            prompt_ids = list(request.prompt_token_ids.ids)
        else:
            prompt_ids = self.tokenizer.encode(request.prompt) if request.prompt else []
        if not prompt_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty: it must contain at least one token")
        migration = Migration(request.request_id or uuid.uuid4().hex, prompt_ids, params, self.tokenizer)
        async for response in self._run(migration, context):
            yield response

    async def _run(self, migration: Migration, context: grpc.aio.ServicerContext) -> AsyncIterator:
        """Submit to a group; on UNAVAILABLE mid-way, resubmit what is left to another, until finished."""
        avoid: set[str] = set()
        full: set[str] = set()  # groups that refused it for a full queue
        while not migration.mirror.finished:
            if not migration.resumable:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {migration.request_id}: its engine group "
                                    "went away during structured output, which cannot continue on another group; "
                                    "retry the request")  # fmt: skip
            try:
                backend = await self.pool.acquire(self._placement_deadline(context), avoid | full, migration.remaining)
            except NoBackend as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; request {migration.request_id} not placed")
            try:
                async for response in self._attempt(backend, migration, context.time_remaining()):
                    yield response
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    full.add(backend.address)
                    if self.pool.serving_addresses() <= full:  # every group is full: the client backs off
                        await context.abort(exc.code(), exc.details())
                    continue
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    await context.abort(exc.code(), exc.details())
                avoid = {backend.address}
                self._note_failure(migration, backend, exc)
                await asyncio.sleep(_RETRY_PAUSE_S)

    def _placement_deadline(self, context: grpc.aio.ServicerContext) -> float:
        """Until when (time.monotonic()) a request may wait for a serving group, at each placement: a little
        before the client's deadline (which would turn UNAVAILABLE into DEADLINE_EXCEEDED), else
        --placement-timeout."""
        remaining = context.time_remaining()
        wait = self.placement_timeout_s if remaining is None else remaining - min(0.5, remaining / 10)
        return time.monotonic() + wait

    async def _attempt(self, backend: Backend, migration: Migration, timeout: float | None) -> AsyncIterator:
        """One submission to one group, for the client's remaining time (none: no deadline)."""
        owed = migration.remaining
        call = backend.stub.Generate(migration.submission(), timeout=timeout)
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

    async def GetServerInfo(self, request_bytes: bytes, context) -> generate_pb2.ServerInfo:  # noqa: N802
        """The info of a serving group (every group of a release runs the same engine config)."""
        request = await parse_request(generate_pb2.GetServerInfoRequest, request_bytes, context)
        backend = self.pool.pick(set())
        if backend is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine group is serving")
        try:
            return await backend.stub.GetServerInfo(request, timeout=context.time_remaining() or 10)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details())


def parse_backend(backend: str) -> tuple[str, str | None]:
    """'HOST:PORT' or 'HOST:PORT@METRICS_PORT' -> (address, the scheduler's /metrics URL or None)."""
    address, _, metrics_port = backend.partition("@")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or (metrics_port and not metrics_port.isdigit()):
        raise ValueError(f"a backend is HOST:PORT or HOST:PORT@METRICS_PORT, got {backend!r}")
    return address, f"http://{host}:{metrics_port}/metrics" if metrics_port else None


def _ended_early(backend: Backend) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
        details=f"the stream from {backend.address} ended before the request finished",
    )  # fmt: skip


async def start_gateway(
    pool: Pool, tokenizer: Tokenizer, *, host: str, port: int, placement_timeout_s: float
) -> tuple[grpc.aio.Server, GatewayServicer, int]:
    """Serve the public API, grpc.health.v1 (SERVING while some group serves) and reflection."""
    servicer = GatewayServicer(pool, tokenizer, placement_timeout_s)
    health = health_aio.HealthServicer()
    await set_public_status(health, pool.any_serving)  # before the port opens: no probe sees the default SERVING
    server, bound = await start_public_server(servicer, health, f"{host}:{port}")
    pool.on_change.append(lambda serving: asyncio.get_running_loop().create_task(set_public_status(health, serving)))
    await set_public_status(health, pool.any_serving)  # in case it changed while the server started
    return server, servicer, bound


async def serve_gateway(
    *, tokenizer_path: str, host: str, port: int, backends: list[str], k8s_service: str | None, namespace: str,
    port_name: str, placement_timeout_s: float,
) -> None:  # fmt: skip
    """Run until SIGTERM/SIGINT: static backends, or those of a Kubernetes Service's EndpointSlices."""
    from minedraft.gateway.discovery import watch_endpoint_slices

    tokenizer = load_tokenizer(tokenizer_path)
    pool = Pool()
    server, _, bound = await start_gateway(
        pool, tokenizer, host=host, port=port, placement_timeout_s=placement_timeout_s
    )
    watcher = None
    if k8s_service:
        watcher = asyncio.get_running_loop().create_task(watch_endpoint_slices(pool, k8s_service, namespace, port_name))
        log.info("gateway on %s:%d, engine groups from the EndpointSlices of %s/%s", host, bound, namespace,
                 k8s_service)  # fmt: skip
    else:
        pool.set_addresses(dict(parse_backend(b) for b in backends))
        log.info("gateway on %s:%d in front of %s", host, bound, ", ".join(backends))
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    await server.stop(grace=5)
    await pool.close()
