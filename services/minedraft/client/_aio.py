"""Asyncio client over a grpc.aio channel."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.api import generate_pb2 as pb
from minedraft.api import generate_pb2_grpc
from minedraft.client._common import UNSET, ClientBase, ResumableStream, completion_from_deltas
from minedraft.client.retry import Deadline, retry_delay
from minedraft.client.types import Completion, Delta, MineDraftError, ServerInfo

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from minedraft.client._common import GenerateArguments, Prompt, Timeout

_Resp = TypeVar("_Resp")


class AsyncClient(ClientBase):
    """Asyncio client of a MineDraft server; the same arguments and results as `Client`.

    The grpc.aio channel is created on first use, in the running event loop, and is bound to that loop:
    use one AsyncClient per loop. `close()` is a coroutine.
    """

    def _connect(self) -> None:
        self._channel: grpc.aio.Channel | None = None
        self._stub: generate_pb2_grpc.MineDraftStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None

    async def generate(
        self, prompt: Prompt, *, timeout: Timeout = UNSET, **arguments: Unpack[GenerateArguments]
    ) -> Completion:
        """Generate a completion: the concatenated deltas of `stream`, which takes the same arguments."""
        return completion_from_deltas([d async for d in self.stream(prompt, timeout=timeout, **arguments)])

    def stream(
        self, prompt: Prompt, *, timeout: Timeout = UNSET, **arguments: Unpack[GenerateArguments]
    ) -> AsyncIterator[Delta]:
        """Stream a completion as Deltas (`async for`); the RPC starts at the first step, closing early cancels it."""
        return self._stream(self._resumable(prompt, arguments), self._seconds(timeout))

    async def server_info(self, *, timeout: Timeout = UNSET) -> ServerInfo:
        reply = await self._unary(self._stubs()[0].GetServerInfo, pb.GetServerInfoRequest(), timeout)
        return ServerInfo.from_proto(reply)

    async def health(self, service: str = "", *, timeout: Timeout = UNSET) -> bool:
        """True if the standard grpc.health.v1 service reports SERVING ("" = the whole server)."""
        request = health_pb2.HealthCheckRequest(service=service)
        reply = await self._unary(self._stubs()[1].Check, request, timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = self._health = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _stubs(self) -> tuple[generate_pb2_grpc.MineDraftStub, health_pb2_grpc.HealthStub]:
        if self._channel is None:
            if self._creds is None:
                self._channel = grpc.aio.insecure_channel(self._target, self._options)
            else:
                self._channel = grpc.aio.secure_channel(self._target, self._creds, self._options)
            self._stub = generate_pb2_grpc.MineDraftStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        assert self._stub is not None and self._health is not None
        return self._stub, self._health

    async def _unary(self, method: Callable[..., Awaitable[_Resp]], request: Any, timeout: Timeout) -> _Resp:
        deadline = Deadline(self._seconds(timeout))
        for attempt in itertools.count(1):
            try:
                return await method(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as err:
                await self._backoff_or_raise(err, attempt, deadline)
        raise AssertionError("unreachable")

    async def _stream(self, stream: ResumableStream, timeout: float | None) -> AsyncIterator[Delta]:
        deadline, attempt = Deadline(timeout), 1
        while not stream.finished:
            call, msg, attempt = await self._open_stream(stream.request(), deadline, attempt)
            try:
                while msg is not None:
                    yield stream.take(msg)
                    msg = await _read(call)
            except grpc.RpcError as err:  # after the first message: resumed where that repeats no output
                if stream.finished:  # the final message came before the break: the output is whole
                    return
                stream.check_resumable(err)
                await self._backoff_or_raise(err, attempt, deadline)
                attempt += 1
            else:
                stream.check_finished()
            finally:
                call.cancel()  # no-op once complete; stops the server's work if the caller stopped early

    async def _open_stream(
        self, request: pb.GenerateRequest, deadline: Deadline, first: int
    ) -> tuple[grpc.aio.UnaryStreamCall, pb.GenerateResponse | None, int]:
        """Start Generate and wait for its first message, retrying while nothing has arrived; with the attempt
        it took (attempts count over a whole stream, its resumptions included)."""
        stub = self._stubs()[0]
        for attempt in itertools.count(first):
            call = stub.Generate(request, timeout=deadline.remaining(), metadata=self._metadata)
            try:
                return call, await _read(call), attempt
            except grpc.RpcError as err:
                await self._backoff_or_raise(err, attempt, deadline)
        raise AssertionError("unreachable")

    async def _backoff_or_raise(self, err: grpc.RpcError, attempt: int, deadline: Deadline) -> None:
        delay = retry_delay(self._retry, err, attempt, deadline)
        if delay is None:
            raise MineDraftError.from_rpc_error(err) from err
        await asyncio.sleep(delay)


async def _read(call: grpc.aio.UnaryStreamCall) -> pb.GenerateResponse | None:
    msg = await call.read()
    return None if msg is grpc.aio.EOF else msg
