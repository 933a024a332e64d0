"""`minedraft scheduler`: the public MineDraft gRPC service (asyncio) in front of the step loop."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

import minedraft
from minedraft.api import generate_pb2, generate_pb2_grpc
from minedraft.config import EngineConfig
from minedraft.engine.engine import LLMEngine
from minedraft.metrics import Metrics
from minedraft.model.tokenizer import Tokenizer, load_tokenizer
from minedraft.scheduler.executor import DEFAULT_STEP_DEADLINE_FLOOR_S, RemoteExecutor
from minedraft.scheduler.loop import EngineFailed, EngineLoop, Sink, StreamItem
from minedraft.scheduler.step_deadline import StepDeadline
from minedraft.serving import PUBLIC_SERVICE, grpc_options
from minedraft.wire import sampling_from_proto, stats_to_proto

log = logging.getLogger("minedraft.scheduler")

_FINISH_REASONS = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
}


def describe_validation_error(exc: ValidationError) -> str:
    """'temperature: Input should be greater than or equal to 0' rather than pydantic's long form."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors())


class MineDraftServicer(generate_pb2_grpc.MineDraftServicer):
    def __init__(self, tokenizer: Tokenizer, config: EngineConfig, max_waiting: int) -> None:
        self.loop: EngineLoop | None = None  # set once the workers are ready
        self.tokenizer = tokenizer
        self.config = config
        self.max_waiting = max_waiting

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is starting: the workers are not ready yet")
        if self.loop.failed is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.loop.failed)
        try:
            params = sampling_from_proto(request.sampling)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, describe_validation_error(exc))
        prompt_ids = self._prompt_ids(request)
        if not prompt_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty: it must contain at least one token")
        if self.loop.queued >= self.max_waiting:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server is at capacity: {self.loop.queued} requests are waiting (max_waiting_requests="
                f"{self.max_waiting}); retry later",
            )
        request_id = request.request_id or uuid.uuid4().hex
        internal_id = uuid.uuid4().hex  # client ids need not be unique
        sink = Sink(asyncio.get_running_loop())
        self.loop.submit(internal_id, prompt_ids, params, request.prompt or None, sink)
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, ValueError):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                if isinstance(item, EngineFailed):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(item))
                if isinstance(item, BaseException):
                    await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {item}")
                finished = item.finished is not None
                yield self._response(request_id, item)
                if finished:
                    return
        finally:
            if not finished:  # cancelled, deadline exceeded or failed: free its KV on both workers
                self.loop.abort(internal_id)

    def _prompt_ids(self, request: generate_pb2.GenerateRequest) -> list[int]:
        if request.HasField("prompt_token_ids"):
            return list(request.prompt_token_ids.ids)
        return self.tokenizer.encode(request.prompt) if request.prompt else []

    @staticmethod
    def _response(request_id: str, item: StreamItem) -> generate_pb2.GenerateResponse:
        response = generate_pb2.GenerateResponse(request_id=request_id, text=item.text, token_ids=item.token_ids)
        done = item.finished
        if done is not None:
            response.finish_reason = _FINISH_REASONS.get(done.finish_reason, generate_pb2.FINISH_REASON_UNSPECIFIED)
            response.usage.prompt_tokens = len(done.prompt_ids)
            response.usage.completion_tokens = len(done.output_ids)
            response.spec_decode_stats.CopyFrom(stats_to_proto(done.stats))
        return response

    async def GetServerInfo(self, request, context) -> generate_pb2.ServerInfo:  # noqa: N802
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is starting: the workers are not ready yet")
        spec = self.config.speculative_config
        return generate_pb2.ServerInfo(
            version=minedraft.__version__,
            target_model=str(self.config.target_path),
            draft_model=str(self.config.draft_path) if spec else "",
            mode=self.config.mode.value,
            speculative_config_json=json.dumps(spec.model_dump(exclude_none=True)) if spec else "",
            tensor_parallel_size=self.config.tensor_parallel_size,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.loop.engine.max_model_len,
            max_waiting_requests=self.max_waiting,
            vocab_size=self.tokenizer.vocab_size,
        )


def build_engine(
    config: EngineConfig,
    tokenizer: Tokenizer,
    verifier: str,
    drafter: str | None,
    startup_timeout_s: float,
    step_deadline_floor_s: float = DEFAULT_STEP_DEADLINE_FLOOR_S,
) -> LLMEngine:
    """Wait for the workers, then build the engine over them (the scheduler holds no model)."""
    drafter = drafter if config.speculative_config is not None else None
    executor = RemoteExecutor(verifier, drafter, StepDeadline(floor_s=step_deadline_floor_s))
    executor.wait_until_serving(startup_timeout_s)
    executor.announce()  # workers drop the requests of a scheduler this one replaces, before any arrive
    info = executor.verifier_info()
    return LLMEngine(config, executor, tokenizer, list(info.eos_token_ids), info.max_model_len)


async def serve_scheduler(
    config: EngineConfig,
    *,
    host: str,
    port: int,
    verifier: str,
    drafter: str | None,
    max_waiting: int,
    metrics_port: int | None,
    startup_timeout_s: float,
    step_deadline_floor_s: float = DEFAULT_STEP_DEADLINE_FLOOR_S,
    drain_timeout_s: float = 30.0,
) -> None:
    if config.speculative_config is not None and not drafter:
        raise ValueError("a speculative config needs a drafter address (--drafter)")
    tokenizer = load_tokenizer(config.target_path)
    servicer = MineDraftServicer(tokenizer, config, max_waiting)
    server = grpc.aio.server(options=grpc_options(server=True))
    generate_pb2_grpc.add_MineDraftServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    for name in ("", PUBLIC_SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([PUBLIC_SERVICE, reflection.SERVICE_NAME, "grpc.health.v1.Health"], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    log.info("scheduler listening on %s:%d (NOT_SERVING until the workers are ready)", host, bound)

    metrics = Metrics()
    if metrics_port:
        metrics.serve(metrics_port, addr=host)
    engine = await asyncio.to_thread(
        build_engine, config, tokenizer, verifier, drafter, startup_timeout_s, step_deadline_floor_s
    )
    event_loop = asyncio.get_running_loop()

    def not_serving(reason: str) -> None:  # called from the step-loop thread
        for name in ("", PUBLIC_SERVICE):
            asyncio.run_coroutine_threadsafe(health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING), event_loop)

    loop = EngineLoop(engine, metrics, on_failure=not_serving)
    loop.start()
    servicer.loop = loop
    for name in ("", PUBLIC_SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("scheduler SERVING in %s mode", config.mode.value)

    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await drain(health, loop, drain_timeout_s)
    await server.stop(grace=5)  # lets the finished streams deliver their last message
    engine.executor.close()


async def drain(health: health_aio.HealthServicer, loop: EngineLoop, timeout_s: float) -> None:
    """SIGTERM: NOT_SERVING (load balancers stop sending), refuse new requests, finish the running ones."""
    loop.draining = True  # before NOT_SERVING shows: whoever sees that finds new requests refused
    for name in ("", PUBLIC_SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("draining: finishing the requests in flight (at most %gs)", timeout_s)
    cut = await asyncio.to_thread(loop.drain, timeout_s)
    if cut:
        log.warning("drain timeout: %d requests cut off with UNAVAILABLE", cut)
    log.info("drained")
