"""`minedraft gateway`: the process that serves the public MineDraft API in front of N engine groups.

Stateless: a request lives here only while its stream is open. Both public frontends are the scheduler's
own (`frontends/`) over the gateway's engine client (`routed_engine.py`); `router.py` places each request
on the group its routing policy picks (`policies.py`) and, when that group fails mid-request, submits it
again to another group as prompt + the tokens already streamed, with the remaining max_tokens and the same
seed; the client's stream goes on. This module wires the listeners, the pool of groups and their discovery.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1.health import aio as health_aio

from minedraft.config import EngineConfig
from minedraft.frontends.auth import ApiKeys, GrpcAuthInterceptor
from minedraft.frontends.chat import ChatTemplate
from minedraft.frontends.generate import Generator, Limits
from minedraft.frontends.grpc_api import MineDraftServicer
from minedraft.frontends.grpc_server import start_public_server
from minedraft.frontends.http_server import HttpServer, start_http, stop_http
from minedraft.frontends.openai_api import OpenAIFrontend
from minedraft.gateway.policies import make_policy
from minedraft.gateway.pool import BackendAccess, Pool
from minedraft.gateway.routed_engine import GrpcSessionHeader, RoutedEngine, SessionHeader
from minedraft.gateway.router import GatewayMetrics, Refused, Router
from minedraft.model.tokenizer import Tokenizer, load_tokenizer
from minedraft.service.grpc_server import PUBLIC_SERVICE
from minedraft.service.health import set_public_status
from minedraft.settings import GatewaySettings

log = logging.getLogger("minedraft.gateway")


def parse_backend(backend: str) -> tuple[str, str | None]:
    """'HOST:PORT' or 'HOST:PORT@METRICS_PORT' -> (address, the scheduler's /metrics URL or None)."""
    address, _, metrics_port = backend.partition("@")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or (metrics_port and not metrics_port.isdigit()):
        raise ValueError(f"a backend is HOST:PORT or HOST:PORT@METRICS_PORT, got {backend!r}")
    return address, f"http://{host}:{metrics_port}/metrics" if metrics_port else None


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
    """The gateway's public listeners: gRPC (health SERVING while some group serves; a request waits for a
    serving group) and, when asked, the OpenAI HTTP API, ready once a group has told its engine's limits."""

    def __init__(self, api: GatewayApi, pool: Pool, tokenizer: Tokenizer, tokenizer_path: str) -> None:
        self.api, self.pool, self.tokenizer = api, pool, tokenizer
        self.metrics = GatewayMetrics(pool)
        policy = make_policy(api.settings.routing_policy)
        self.router = Router(pool, api.settings.placement_timeout, self.metrics, policy)
        self.health = health_aio.HealthServicer()
        self.engine = RoutedEngine(self.router, tokenizer)
        limits = Limits.of(api.settings)
        self.generator = Generator(tokenizer, limits)  # the HTTP API's: its engine is set once a group told its limits
        self.grpc_generator = Generator(tokenizer, limits)
        self.grpc_generator.engine = self.engine
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
            MineDraftServicer(self.grpc_generator), self.health, f"{self.api.host}:{self.api.port}",
            max_receive_bytes=settings.max_request_bytes, tls=tls,
            interceptors=[GrpcAuthInterceptor(self.api.api_keys, [PUBLIC_SERVICE]), GrpcSessionHeader()],
        )  # fmt: skip
        self.pool.on_change.append(self._changed)
        self._changed(self.pool.any_serving)  # in case it changed while the server started
        if settings.http_port:
            try:
                app = SessionHeader(self.frontend.app())
                self.http = await start_http(app, self.api.host, settings.http_port, tls)
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
            registry=self.metrics.registry, spec_decode_metrics=settings.per_request_spec_decode_metrics,
        )  # fmt: skip

    def _changed(self, serving: bool) -> None:
        loop = asyncio.get_running_loop()
        loop.create_task(set_public_status(self.health, serving))
        if serving and self.generator.engine is None and (self._info_task is None or self._info_task.done()):
            self._info_task = loop.create_task(self._learn_engine())

    async def _learn_engine(self) -> None:
        """The HTTP API needs the groups' max_model_len: asked of the first group that serves."""
        try:
            info = await self.router.server_info(10)
        except Refused as exc:
            log.warning("cannot read an engine group's server info (%s); trying again at its next change", exc)
            return
        spec = json.loads(info.speculative_config_json) if info.speculative_config_json else None
        self.frontend.decoding = EngineConfig(speculative_config=spec).decoding()  # the groups', for /v1/models
        self.frontend.lora_adapters = list(info.lora_adapters)
        self.router.policy.block_size, self.router.policy.max_num_seqs = info.kv_block_size, info.max_num_seqs
        self.engine.learn(info)
        self.generator.engine = self.engine
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
