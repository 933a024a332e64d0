"""`minedraft scheduler`: the public APIs (gRPC, and OpenAI HTTP when asked) in front of the step loop.

Both frontends run in this process's one asyncio event loop over one generate interface; the step loop
runs in its own thread.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1.health import aio as health_aio

from minedraft.config import EngineConfig
from minedraft.engine.engine import LLMEngine
from minedraft.frontends.auth import ApiKeys, GrpcAuthInterceptor
from minedraft.frontends.chat import ChatTemplate
from minedraft.frontends.generate import Generator, Limits
from minedraft.frontends.grpc_api import MineDraftServicer
from minedraft.frontends.grpc_server import start_public_server
from minedraft.metrics import Metrics
from minedraft.model.tokenizer import Tokenizer, load_tokenizer
from minedraft.scheduler.loop import EngineLoop
from minedraft.scheduler.recovery import Recovery
from minedraft.scheduler.remote_executor import start_remote_engine
from minedraft.service.grpc_server import PUBLIC_SERVICE
from minedraft.service.health import set_public_status
from minedraft.settings import SchedulerSettings, served_model_name

if TYPE_CHECKING:
    from minedraft.frontends.http_server import HttpServer

log = logging.getLogger("minedraft.scheduler")


@dataclass
class PublicApi:
    """How the scheduler faces clients: its settings, plus the listen address and the API keys (per process,
    and secret: not settings)."""

    settings: SchedulerSettings = field(default_factory=SchedulerSettings)
    host: str = "0.0.0.0"
    port: int = 50051
    api_keys: ApiKeys = field(default_factory=ApiKeys)


def build_engine(
    config: EngineConfig, tokenizer: Tokenizer, verifier: str, drafter: str | None, settings: SchedulerSettings,
    drafter_pool: list[str] | None = None,
) -> LLMEngine:  # fmt: skip
    """Wait for the workers, form their world, then build the engine over them (the scheduler holds no model)."""
    return start_remote_engine(
        config, tokenizer, verifier, drafter, startup_timeout_s=settings.startup_timeout,
        join_timeout_s=settings.join_timeout, settings=settings, drafter_pool=drafter_pool,
    )  # fmt: skip


async def _start_grpc(
    api: PublicApi, servicer: MineDraftServicer, health: health_aio.HealthServicer
) -> grpc.aio.Server:
    settings = api.settings
    server, bound = await start_public_server(
        servicer, health, f"{api.host}:{api.port}",
        max_receive_bytes=settings.max_request_bytes,
        interceptors=[GrpcAuthInterceptor(api.api_keys, [PUBLIC_SERVICE])],
        tls=(settings.tls_cert, settings.tls_key) if settings.tls_cert else None,
    )  # fmt: skip
    log.info("gRPC API on %s:%d%s (NOT_SERVING until the workers are ready)", api.host, bound,
             " with TLS" if settings.tls_cert else "")  # fmt: skip
    return server


class _Serving:
    """The scheduler's serving state, as grpc.health.v1 and the HTTP API's /health both report it."""

    def __init__(self, health: health_aio.HealthServicer) -> None:
        self.health = health
        self.serving = False

    async def set(self, serving: bool) -> None:
        self.serving = serving
        await set_public_status(self.health, serving)


async def serve_scheduler(config: EngineConfig, api: PublicApi, *, verifier: str, drafter: str | None,
                          drafter_pool: list[str] | None = None) -> None:  # fmt: skip
    settings = api.settings
    tokenizer = load_tokenizer(config.tokenizer_path)
    limits = Limits.of(settings)
    generator = Generator(tokenizer, limits)
    state = _Serving(health_aio.HealthServicer())
    await state.set(False)
    model_name = served_model_name(config, settings)
    metrics = Metrics(model_name=model_name)
    spec = config.speculative_config
    metrics.declare_decoding(config.decoding(), spec.num_speculative_tokens if spec else 0,
                             adaptive=spec is not None and spec.adaptive)  # fmt: skip
    if settings.metrics_port:
        metrics.serve(settings.metrics_port, addr=api.host)  # first: a taken port stops us before we listen
    server = await _start_grpc(api, MineDraftServicer(generator), state.health)
    http = None
    try:
        http = await _start_openai(api, config, generator, state, metrics, model_name) if settings.http_port else None
        engine = await asyncio.to_thread(build_engine, config, tokenizer, verifier, drafter, settings,
                                       drafter_pool)  # fmt: skip
    except BaseException:
        if http is not None:
            await http.stop()
        await server.stop(grace=None)
        raise
    event_loop = asyncio.get_running_loop()

    def report(serving: bool, reason: str) -> None:  # called from the step-loop thread
        asyncio.run_coroutine_threadsafe(state.set(serving), event_loop)

    recovery = Recovery.of(settings)
    loop = EngineLoop(engine, engine.executor, metrics, on_state=report, recovery=recovery,
                      stats_interval_s=settings.log_stats_interval, max_waiting=limits.max_waiting)  # fmt: skip
    loop.start()
    generator.engine = loop
    await state.set(True)
    log.info("scheduler SERVING in %s mode; %s", config.mode.value, _capacity(engine))

    await _until_signalled()
    await drain(state, loop, settings.request_drain_timeout)
    if http is not None:
        http.stop_accepting()
    await server.stop(grace=5)
    if http is not None:
        await http.stop()
    engine.executor.close()


def _capacity(engine: LLMEngine) -> str:
    """What the workers' KV pool allows, for the start-up line."""
    if engine.kv_pool is None:
        return f"max_num_seqs {engine.config.max_num_seqs}"
    blocks, block_size = engine.kv_pool
    full = blocks // -(-engine.max_model_len // block_size)
    return (f"KV cache {blocks} blocks of {block_size} tokens ({blocks * block_size} tokens): {full} requests of "
            f"max_model_len {engine.max_model_len} at once, max_num_seqs {engine.config.max_num_seqs} per batch")


async def _start_openai(
    api: PublicApi, config: EngineConfig, generator: Generator, state: _Serving, metrics: Metrics, model_name: str
) -> HttpServer:
    # Imported here: a scheduler without --http-port starts without FastAPI and uvicorn.
    from minedraft.frontends.http_server import start_http
    from minedraft.frontends.openai_api import OpenAIFrontend

    frontend = OpenAIFrontend(
        generator,
        served_model_name=model_name,
        chat_template=ChatTemplate.from_checkpoint(config.tokenizer_path),
        api_keys=api.api_keys,
        is_serving=lambda: state.serving,
        registry=metrics.registry,
        spec_decode_metrics=api.settings.per_request_spec_decode_metrics,
        decoding=config.decoding(),
        max_body_bytes=api.settings.max_request_bytes,
        lora_adapters=[m.name for m in config.lora_modules],
    )
    settings = api.settings
    return await start_http(frontend.app(), api.host, settings.http_port,
                            (settings.tls_cert, settings.tls_key) if settings.tls_cert else None)  # fmt: skip


async def _until_signalled() -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()


async def drain(state, loop: EngineLoop, timeout_s: float) -> None:
    """SIGTERM: NOT_SERVING (load balancers stop sending), refuse new requests, finish the running ones."""
    loop.draining = True  # before NOT_SERVING shows: whoever sees that finds new requests refused
    await state.set(False)
    log.info("draining: finishing the requests in flight (at most %gs)", timeout_s)
    cut = await asyncio.to_thread(loop.drain, timeout_s)
    if cut:
        log.warning("drain timeout: %d requests cut off with UNAVAILABLE", cut)
    log.info("drained")
