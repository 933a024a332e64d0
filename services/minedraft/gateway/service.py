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
import functools
import json
import logging
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minedraft.api import generate_pb2
from minedraft.config import EngineConfig
from minedraft.engine.request import Request
from minedraft.frontends.auth import ApiKeys, GrpcAuthInterceptor
from minedraft.frontends.chat import ChatTemplate
from minedraft.frontends.generate import GenerateError, Generator, Limits
from minedraft.frontends.http_server import HttpServer, start_http, stop_http
from minedraft.frontends.openai_api import OpenAIFrontend
from minedraft.gateway.pool import Backend, BackendAccess, NoBackend, Pool
from minedraft.model.tokenizer import Tokenizer, load_tokenizer
from minedraft.sampling.params import SamplingParams
from minedraft.serving import (
    PUBLIC_SERVICE,
    parse_generate,
    parse_request,
    request_prompt,
    set_public_status,
    start_public_server,
)
from minedraft.settings import GatewaySettings
from minedraft.wire import (
    FINISH_REASONS,
    finish_reason_from_proto,
    sampling_to_proto,
    stats_from_proto,
    stats_to_proto,
)

log = logging.getLogger("minedraft.gateway")

_RETRY_PAUSE_S = 0.05  # between attempts on a group that failed before it was seen NOT_SERVING


def _nothing() -> None:
    pass


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
        self.sent_tokens = 0  # output tokens already streamed to the client

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.mirror.output_ids)

    def submission(self) -> generate_pb2.GenerateRequest:
        """Prompt + tokens so far (resumed: they count as output for min_tokens and penalties), the remaining
        max_tokens, the pinned seed."""
        produced = len(self.mirror.output_ids)
        params = self.params.model_copy(update={"max_tokens": self.remaining,
                                                "resumed_tokens": self.params.resumed_tokens + produced})  # fmt: skip
        if produced:  # the client has the prompt's logprobs already (they came with the first tokens)
            params = params.model_copy(update={"prompt_logprobs": None})
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
            self.mirror.stats.merge(stats_from_proto(reply.spec_decode_stats))
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
    """Runs one request over the engine groups, for both public protocols: placed on the group with the least
    outstanding work; resubmitted to another when its group fails mid-way, until it is finished."""

    def __init__(self, pool: Pool, placement_timeout_s: float, metrics: GatewayMetrics | None = None) -> None:
        self.pool = pool
        self.placement_timeout_s = placement_timeout_s
        self.metrics = metrics

    async def run(
        self, migration: Migration, time_remaining: Callable[[], float | None], on_placed: Callable[[], None] = _nothing
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The client's messages; raises Refused. `time_remaining`: the client's deadline (None: none)."""
        avoid: set[str] = set()
        full: set[str] = set()  # groups that refused it for a full queue
        while not migration.mirror.finished:
            try:
                backend = await self.pool.acquire(self._placement_deadline(time_remaining()), avoid | full,
                                                  migration.remaining)  # fmt: skip
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


class GatewayServicer:
    """The public gRPC API at the gateway: prompts checked and tokenized as the HTTP API's (and a scheduler's)
    generate interface does, then routed (migration keeps the client's deadline for each placement)."""

    def __init__(self, router: Router, generator: Generator) -> None:
        self.router = router
        self.generator = generator

    async def Generate(self, request_bytes: bytes, context: grpc.aio.ServicerContext):  # noqa: N802
        request, params = await parse_generate(request_bytes, context)
        prompt = request_prompt(request)
        try:
            self.generator.check_prompt_size(prompt)
            prompt_ids = await self.generator.prompt_ids(prompt)
        except GenerateError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        if not prompt_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty: it must contain at least one token")
        tokenizer = self.generator.tokenizer
        migration = Migration(request.request_id or uuid.uuid4().hex, prompt_ids, params, tokenizer)
        try:
            async for response in self.router.run(migration, context.time_remaining):
                yield response
        except Refused as exc:
            await context.abort(exc.code, exc.details)

    async def GetServerInfo(self, request_bytes: bytes, context) -> generate_pb2.ServerInfo:  # noqa: N802
        await parse_request(generate_pb2.GetServerInfoRequest, request_bytes, context)
        try:
            return await self.router.server_info(context.time_remaining())
        except Refused as exc:
            await context.abort(exc.code, exc.details)


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


@dataclass
class GatewayApi:
    """How the gateway faces clients (its settings, listen address and the clients' API keys) and how it
    reaches the engine groups."""

    settings: GatewaySettings = field(default_factory=GatewaySettings)
    host: str = "0.0.0.0"
    port: int = 50050
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    access: BackendAccess = field(default_factory=BackendAccess)


class _Public:
    """The gateway's public listeners: gRPC (health SERVING while some group serves) and, when asked, the
    OpenAI HTTP API, ready once a group has told its engine's limits."""

    def __init__(self, api: GatewayApi, pool: Pool, tokenizer: Tokenizer, tokenizer_path: str) -> None:
        self.api, self.pool, self.tokenizer = api, pool, tokenizer
        self.metrics = GatewayMetrics(pool)
        self.router = Router(pool, api.settings.placement_timeout, self.metrics)
        self.health = health_aio.HealthServicer()
        limits = Limits(max_prompt_bytes=api.settings.max_prompt_bytes, max_waiting=api.settings.max_waiting_requests)
        self.generator = Generator(tokenizer, limits)
        self.model_name = api.settings.served_model_name or Path(tokenizer_path).name
        self.tokenizer_path = tokenizer_path
        self.grpc: grpc.aio.Server | None = None
        self.http: HttpServer | None = None
        self._info_task: asyncio.Task | None = None

    @property
    def serving_http(self) -> bool:
        return self.generator.engine is not None and self.pool.any_serving

    async def start(self) -> int:
        settings = self.api.settings
        tls = (settings.tls_cert, settings.tls_key) if settings.tls_cert else None
        await set_public_status(self.health, self.pool.any_serving)  # before the port opens: no default SERVING
        self.grpc, bound = await start_public_server(
            GatewayServicer(self.router, self.generator), self.health, f"{self.api.host}:{self.api.port}",
            max_receive_bytes=settings.max_request_bytes, tls=tls,
            interceptors=[GrpcAuthInterceptor(self.api.api_keys, [PUBLIC_SERVICE])],
        )  # fmt: skip
        self.pool.on_change.append(self._changed)
        self._changed(self.pool.any_serving)  # in case it changed while the server started
        if settings.http_port:
            try:
                self.http = await start_http(self.frontend.app(), self.api.host, settings.http_port, tls)
            except BaseException:
                await self.grpc.stop(grace=None)
                raise
        return bound

    @functools.cached_property
    def frontend(self) -> OpenAIFrontend:
        settings = self.api.settings
        return OpenAIFrontend(
            self.generator, served_model_name=self.model_name,
            chat_template=ChatTemplate.from_checkpoint(Path(self.tokenizer_path)), api_keys=self.api.api_keys,
            is_serving=lambda: self.serving_http, max_body_bytes=settings.max_request_bytes,
            registry=self.metrics.registry,
        )  # fmt: skip

    def _changed(self, serving: bool) -> None:
        loop = asyncio.get_running_loop()
        loop.create_task(set_public_status(self.health, serving))
        if serving and self.generator.engine is None and (self._info_task is None or self._info_task.done()):
            self._info_task = loop.create_task(self._learn_engine())

    async def _learn_engine(self) -> None:
        """The HTTP API needs the groups' max_model_len: asked of the first group that serves."""
        from minedraft.gateway.routed_engine import RoutedEngine  # it builds on this module's Router

        try:
            info = await self.router.server_info(10)
        except Refused as exc:
            log.warning("cannot read an engine group's server info (%s); trying again at its next change", exc)
            return
        spec = json.loads(info.speculative_config_json) if info.speculative_config_json else None
        self.frontend.decoding = EngineConfig(speculative_config=spec).decoding()  # the groups', for /v1/models
        self.generator.engine = RoutedEngine(self.router, self.tokenizer, info)
        log.info("engine groups serve %s in %s mode, max_model_len %d", self.model_name, info.mode, info.max_model_len)

    async def stop(self) -> None:
        if self.http is not None:
            self.http.stop_accepting()
        if self.grpc is not None:
            await self.grpc.stop(grace=5)
        await stop_http(self.http)


async def serve_gateway(
    api: GatewayApi, *, tokenizer_path: str, backends: list[str], k8s_service: str | None, namespace: str,
    port_name: str,
) -> None:  # fmt: skip
    """Run until SIGTERM/SIGINT: static backends, or those of a Kubernetes Service's EndpointSlices."""
    from minedraft.gateway.discovery import watch_endpoint_slices

    tokenizer = load_tokenizer(tokenizer_path)
    pool = Pool(api.access)
    public = _Public(api, pool, tokenizer, tokenizer_path)
    bound = await public.start()
    where = f"{api.host}:{bound}" + (" with TLS" if api.settings.tls_cert else "") + (
        f", OpenAI HTTP on port {api.settings.http_port}" if api.settings.http_port else "")  # fmt: skip
    watcher = None
    if k8s_service:
        watcher = asyncio.get_running_loop().create_task(watch_endpoint_slices(pool, k8s_service, namespace, port_name))
        log.info("gateway on %s, engine groups from the EndpointSlices of %s/%s", where, namespace, k8s_service)
    else:
        pool.set_addresses(dict(parse_backend(b) for b in backends))
        log.info("gateway on %s in front of %s", where, ", ".join(backends))
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    await public.stop()
    await pool.close()
