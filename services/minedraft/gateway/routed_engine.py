"""The gateway's engine client: both public frontends run over the engine groups through it.

The gRPC servicer, the HTTP app, their generate interface and their limits are the scheduler's own
(`frontends/`); only the engine under them differs: a request submitted here goes through the gateway's
`Router`, so it is placed by the routing policy and migrates when its group fails.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
from collections.abc import Callable

import grpc

from minedraft.api import generate_pb2
from minedraft.config import EngineConfig, LoraModule
from minedraft.engine.intake import check_request
from minedraft.engine_client import Sink, StreamItem
from minedraft.frontends.generate import ErrorKind, GenerateError
from minedraft.frontends.grpc_api import lora_refusal
from minedraft.gateway.policies import SESSION_HEADER
from minedraft.gateway.router import Migration, Refused, Router
from minedraft.model.tokenizer import Tokenizer
from minedraft.sampling.params import SamplingParams
from minedraft.wire import logprobs_from_proto

KINDS = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.INVALID,
    grpc.StatusCode.ALREADY_EXISTS: ErrorKind.DUPLICATE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorKind.BUSY,
    grpc.StatusCode.UNAVAILABLE: ErrorKind.UNAVAILABLE,
}


# The x-session-id of the request being handled (the engine client's interface carries no headers).
_session: contextvars.ContextVar[str | None] = contextvars.ContextVar("session", default=None)


class SessionHeader:
    """ASGI middleware: each HTTP request's x-session-id, for `RoutedEngine.submit` (same task, same context)."""

    def __init__(self, app) -> None:
        self.app = app
        self._name = SESSION_HEADER.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            value = next((v for k, v in scope["headers"] if k.lower() == self._name), None)
            _session.set(value.decode("latin-1") if value else None)
        await self.app(scope, receive, send)


class GrpcSessionHeader(grpc.aio.ServerInterceptor):
    """Each gRPC call's x-session-id, for `RoutedEngine.submit` (the call's handler runs in the same task)."""

    async def intercept_service(self, continuation, handler_call_details):
        _session.set(dict(handler_call_details.invocation_metadata or ()).get(SESSION_HEADER))
        return await continuation(handler_call_details)


class RoutedEngine:
    """An `engine_client.EngineClient` over the engine groups. `info` is a group's ServerInfo, once one has
    told it (`learn`); until then a request is checked by the group it is placed on."""

    failed: str | None = None  # a request waits for a serving group (up to --placement-timeout)
    speculation: dict | None = None  # each group's own: ask its scheduler
    lora_adapters: list[str] | None = None  # the groups' once told (until then each group checks its own)

    def __init__(self, router: Router, tokenizer: Tokenizer) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.info: generate_pb2.ServerInfo | None = None
        self.config = EngineConfig()
        self._tasks: dict[str, asyncio.Task] = {}

    def learn(self, info: generate_pb2.ServerInfo) -> None:
        self.info = info
        # The groups' speculative config: check_request bounds num_speculative_tokens by it.
        spec = json.loads(info.speculative_config_json) if info.speculative_config_json else None
        self.config = EngineConfig(speculative_config=spec)
        self.lora_adapters = list(info.lora_adapters)

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len if self.info is not None else 0

    @property
    def kv_pool(self) -> tuple[int, int] | None:
        return None  # each group has its own

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's own checks, here before a group is asked: they read `max_model_len`, `tokenizer` and
        `config.speculative_config`, which this class has as the engine does once a group told them."""
        if self.info is not None or not prompt_ids:
            check_request(self, prompt_ids, params)  # an empty prompt is refused before anything

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, prompt: str | None,
               sink: Sink, lora: str | None = None, deadline: float | None = None) -> None:  # fmt: skip
        migration = Migration(request_id, prompt_ids, params, self.tokenizer, _session.get(), lora)
        stream = self._stream(migration, sink, _time_remaining(deadline))
        task = asyncio.get_running_loop().create_task(stream, name=f"request-{request_id}")
        self._tasks[request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request_id, None))

    def abort(self, request_id: str) -> None:
        """The client went away: the group's stream is cancelled, which frees its KV there."""
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def load_lora(self, module: LoraModule) -> None:
        """Load the adapter on every engine group (each on all its workers)."""
        await self._every_group("LoadLoraAdapter", generate_pb2.LoadLoraAdapterRequest(
            lora_name=module.name, lora_path=module.path, draft_path=module.draft_path or ""))
        if self.lora_adapters is not None:  # else the groups tell theirs, this one among them
            self.lora_adapters = [*self.lora_adapters, module.name]

    async def unload_lora(self, name: str) -> None:
        await self._every_group("UnloadLoraAdapter", generate_pb2.UnloadLoraAdapterRequest(lora_name=name))
        if self.lora_adapters is not None:
            self.lora_adapters = [n for n in self.lora_adapters if n != name]

    async def _every_group(self, method: str, request) -> None:
        """Call `method` on every group's scheduler at once; the first refusal is raised as the group gave it
        (a group that refuses is named when there are several)."""
        backends = list(self.router.pool.backends.values())
        if not backends:
            raise GenerateError(ErrorKind.UNAVAILABLE, "no engine group is known")
        metadata = self.router.pool.access.metadata
        replies = await asyncio.gather(*(getattr(b.stub, method)(request, metadata=metadata) for b in backends),
                                       return_exceptions=True)  # fmt: skip
        for backend, reply in zip(backends, replies, strict=True):
            if not isinstance(reply, grpc.aio.AioRpcError):
                if isinstance(reply, BaseException):
                    raise reply
                continue
            where = f"engine group {backend.address}: " if len(backends) > 1 else ""
            refusal = lora_refusal(reply.code(), where + (reply.details() or ""))
            if refusal is not None:
                raise refusal
            raise GenerateError(KINDS.get(reply.code(), ErrorKind.INTERNAL), where + (reply.details() or ""))

    async def server_info(self, timeout: float | None) -> generate_pb2.ServerInfo:
        """A serving group's (every group of a release runs the same engine config)."""
        try:
            return await self.router.server_info(timeout)
        except Refused as exc:
            raise _refusal(exc) from None

    async def drafter_pools(self, timeout: float | None) -> dict[str, generate_pb2.DrafterPoolInfo | None]:
        return await self.router.drafter_pools(timeout)

    async def _stream(self, migration: Migration, sink: Sink, time_remaining: Callable[[], float | None]) -> None:
        try:
            async for reply in self.router.run(migration, time_remaining, on_placed=sink.started):
                finished = migration.mirror if migration.mirror.finished else None
                sink.put(StreamItem(reply.text, list(reply.token_ids), finished, logprobs_from_proto(reply.logprobs),
                                    logprobs_from_proto(reply.prompt_logprobs)))  # fmt: skip
        except Refused as exc:
            sink.put(_refusal(exc))


def _refusal(exc: Refused) -> GenerateError:
    return GenerateError(KINDS.get(exc.code, ErrorKind.INTERNAL), exc.details, grpc_status=exc.code.name)


def _time_remaining(deadline: float | None) -> Callable[[], float | None]:
    """The client's remaining seconds at each call (None: no deadline)."""
    if deadline is None:
        return lambda: None
    return lambda: deadline - time.monotonic()
