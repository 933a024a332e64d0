"""The engine groups behind a gateway: their health, the work this gateway has sent them, and the choice.

Each group's scheduler is watched through `grpc.health.v1.Health/Watch` (pushed, not polled); a group
that is NOT_SERVING or unreachable is skipped. Among the serving ones a request goes to the group with
the least outstanding work: the requests in the group (the larger of what this gateway has in flight
there and what the scheduler last reported, waiting + running, plus what this gateway sent since, so
that gateway replicas see each other's load), then the tokens this gateway is still owed there.
The scheduler's report is its Prometheus metrics, read every `LOAD_INTERVAL_S` when its metrics port is
known: its queue, KV use and speed (`Measured`), which the routing policies read (`policies.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.api import generate_pb2_grpc
from minedraft.metrics import (
    GENERATION_TOKENS,
    ITL_SECONDS,
    KV_CACHE_USAGE,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PREFILL_SECONDS,
    PROMPT_TOKENS,
    STEP_SECONDS,
    Samples,
)
from minedraft.metrics import scrape as _scrape
from minedraft.service.grpc_server import PUBLIC_SERVICE, grpc_options

log = logging.getLogger("minedraft.gateway")

_REWATCH_S = 0.5  # pause before watching a group's health again after the watch broke
LOAD_INTERVAL_S = 1.0
_QUEUE_GAUGES = (NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING)


@dataclass
class Measured:
    """What a group's scheduler reported at its last scrape: KV use, and its recent speed from the growth of
    its counters since the scrape before (None until a request finished there)."""

    kv_usage: float = 0.0
    token_seconds: float | None = None  # a running request's time per output token (finished requests' ITL)
    running: float = 1.0  # ... while this many requests ran, on average over the steps
    prefill_token_seconds: float | None = None  # prefill time per prompt token
    _last: Samples = field(default_factory=dict, repr=False)

    def update(self, samples: Samples) -> None:
        self.kv_usage = samples.get(KV_CACHE_USAGE, 0.0)
        token_seconds = self._rate(samples, ITL_SECONDS + "_sum", ITL_SECONDS + "_count")
        if token_seconds:
            self.token_seconds = token_seconds
            self.running = self._mean_running(samples, token_seconds)
        prefill = self._rate(samples, PREFILL_SECONDS + "_sum", PROMPT_TOKENS + "_total")
        self.prefill_token_seconds = prefill or self.prefill_token_seconds
        self._last = samples

    def _mean_running(self, samples: Samples, token_seconds: float) -> float:
        """Requests running while the group stepped, by Little's law: tokens made in its step time, times a
        request's time per token. (The running gauge is read at the scrapes only: short requests that came
        and went between two scrapes would count as one, and a group that served a burst at a batch of 8
        would be believed that slow at a batch of 1.)"""
        busy = self._grown(samples, STEP_SECONDS + "_sum")
        tokens = self._grown(samples, GENERATION_TOKENS + "_total")
        if busy <= 0 or tokens <= 0:  # a scheduler without these series: the gauges, as read
            return max(self._last.get(NUM_REQUESTS_RUNNING, 0.0), samples.get(NUM_REQUESTS_RUNNING, 0.0), 1.0)
        return max(tokens * token_seconds / busy, 1.0)

    def _grown(self, samples: Samples, name: str) -> float:
        return samples.get(name, 0.0) - self._last.get(name, 0.0)

    def _rate(self, samples: Samples, numerator: str, denominator: str) -> float | None:
        """d(numerator) / d(denominator) since the last scrape; None when the denominator did not grow."""
        grown = self._grown(samples, denominator)
        if not self._last or grown <= 0:
            return None
        return self._grown(samples, numerator) / grown


class NoBackend(Exception):
    """No engine group serves (or none but those to avoid) before the deadline."""


@dataclass(eq=False)
class Backend:
    """One engine group, reached at its scheduler's address."""

    address: str
    channel: grpc.aio.Channel
    stub: generate_pb2_grpc.MineDraftStub
    serving: bool = False
    metrics_url: str | None = None  # the scheduler's Prometheus endpoint, if known
    requests: int = 0  # requests this gateway has in flight on the group
    tokens: int = 0  # tokens still owed on them (their remaining max_tokens)
    reported: int | None = None  # the scheduler's waiting + running requests at its last report
    sent_since_report: int = 0  # requests this gateway placed there since that report
    measured: Measured = field(default_factory=Measured)
    tasks: list[asyncio.Task] = field(default_factory=list, repr=False)

    @property
    def load(self) -> tuple[int, int]:
        queued = self.requests if self.reported is None else max(self.requests, self.reported + self.sent_since_report)
        return queued, self.tokens

    def take_report(self, queued: int) -> None:
        self.reported = queued
        self.sent_since_report = 0


def least_work(backends: list[Backend]) -> Backend:
    return min(backends, key=lambda b: b.load)


Choose = Callable[[list[Backend]], Backend]  # one of several serving groups (a routing policy's choice)


@dataclass(frozen=True)
class BackendAccess:
    """How the gateway reaches the schedulers: its own API key (sent on every call, never a client's) and,
    for schedulers that serve TLS, the certificates it trusts and the name their certificate carries."""

    api_key: str | None = None
    tls_ca: bytes | None = None
    tls_server_name: str | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def channel(self, address: str) -> grpc.aio.Channel:
        options = grpc_options()
        if self.tls_ca is None:
            return grpc.aio.insecure_channel(address, options=options)
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(self.tls_ca), options=options)


class Pool:
    """The current set of backends; `set_addresses` applies what discovery reports."""

    def __init__(self, access: BackendAccess | None = None) -> None:
        self.access = access or BackendAccess()
        self.backends: dict[str, Backend] = {}
        self._changed = asyncio.Event()
        self.on_change: list[Callable[[bool], None]] = []  # called with `any_serving` after every change

    def set_addresses(self, addresses: dict[str, str | None]) -> None:
        """Add new groups (watched from now on), drop the ones discovery no longer lists.

        `addresses`: scheduler address -> its Prometheus /metrics URL (None: not known)."""
        for address in addresses.keys() - self.backends.keys():
            self._add(address, addresses[address])
        for address in self.backends.keys() - addresses.keys():
            self._remove(address)
        self._notify()

    def _add(self, address: str, metrics_url: str | None) -> None:
        channel = self.access.channel(address)
        backend = Backend(address, channel, generate_pb2_grpc.MineDraftStub(channel), metrics_url=metrics_url)
        loop = asyncio.get_running_loop()
        backend.tasks.append(loop.create_task(self._watch(backend)))
        if metrics_url:
            backend.tasks.append(loop.create_task(self._read_load(backend)))
        self.backends[address] = backend
        log.info("engine group %s added", address)

    def _remove(self, address: str) -> None:
        backend = self.backends.pop(address)
        backend.serving = False
        for task in backend.tasks:
            task.cancel()
        # in-flight streams on it keep their channel until they end; close it once they have
        asyncio.get_running_loop().create_task(backend.channel.close(grace=None if not backend.requests else 30))
        log.info("engine group %s removed", address)

    async def _watch(self, backend: Backend) -> None:
        health = health_pb2_grpc.HealthStub(backend.channel)
        while True:
            try:
                async for reply in health.Watch(health_pb2.HealthCheckRequest(service=PUBLIC_SERVICE)):
                    self._set_serving(backend, reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.aio.AioRpcError:
                pass
            self._set_serving(backend, False)
            await asyncio.sleep(_REWATCH_S)

    async def _read_load(self, backend: Backend) -> None:
        """The scheduler's queue (waiting + running requests) and speed, every LOAD_INTERVAL_S; the queue is
        unknown when unreadable."""
        while True:
            try:
                samples = await asyncio.to_thread(_scrape, backend.metrics_url)
                backend.take_report(int(sum(samples.get(name, 0.0) for name in _QUEUE_GAUGES)))
                backend.measured.update(samples)
            except ConnectionError:
                backend.reported = None
            await asyncio.sleep(LOAD_INTERVAL_S)

    def _set_serving(self, backend: Backend, serving: bool) -> None:
        if backend.serving != serving:
            log.info("engine group %s is %s", backend.address, "SERVING" if serving else "NOT_SERVING")
        backend.serving = serving
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        for callback in self.on_change:
            callback(self.any_serving)

    @property
    def any_serving(self) -> bool:
        return any(b.serving for b in self.backends.values())

    def serving_addresses(self) -> set[str]:
        return {b.address for b in self.backends.values() if b.serving}

    def pick(self, avoid: set[str], choose: Choose = least_work) -> Backend | None:
        """The serving group `choose` picks (by default the one with the least outstanding work), preferring
        those not in `avoid`."""
        serving = [b for b in self.backends.values() if b.serving]
        preferred = [b for b in serving if b.address not in avoid] or serving
        return choose(preferred) if preferred else None

    async def acquire(self, deadline: float, avoid: set[str], tokens: int, choose: Choose = least_work) -> Backend:
        """Wait (until `deadline`, time.monotonic()) for a serving group; count the request on it."""
        while (backend := self.pick(avoid, choose)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoBackend(f"no engine group is serving ({len(self.backends)} known)")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=left)
        backend.requests += 1
        backend.sent_since_report += 1
        backend.tokens += tokens
        return backend

    @staticmethod
    def release(backend: Backend, tokens: int) -> None:
        backend.requests -= 1
        backend.tokens -= tokens

    async def close(self) -> None:
        for backend in self.backends.values():
            for task in backend.tasks:
                task.cancel()
            await backend.channel.close(grace=None)
        self.backends.clear()
