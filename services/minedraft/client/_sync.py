"""Blocking client over a grpc channel."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
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


class Client(ClientBase):
    """Blocking client of a MineDraft server. Thread-safe; one channel per client. The arguments: `ClientBase`."""

    def _connect(self) -> None:
        opts = self._options
        self._channel = (
            grpc.insecure_channel(self._target, opts)
            if self._creds is None
            else grpc.secure_channel(self._target, self._creds, opts)
        )
        self._stub = generate_pb2_grpc.MineDraftStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(
        self, prompt: Prompt, *, timeout: Timeout = UNSET, **arguments: Unpack[GenerateArguments]
    ) -> Completion:
        """Generate a completion: the concatenated deltas of `stream`, which takes the same arguments."""
        return completion_from_deltas(self.stream(prompt, timeout=timeout, **arguments))

    def stream(
        self, prompt: Prompt, *, timeout: Timeout = UNSET, **arguments: Unpack[GenerateArguments]
    ) -> Iterator[Delta]:
        """Stream a completion as Deltas; the RPC starts at the first `next`, and stopping early cancels it."""
        return self._stream(self._resumable(prompt, arguments), self._seconds(timeout))

    def server_info(self, *, timeout: Timeout = UNSET) -> ServerInfo:
        reply = self._unary(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)
        return ServerInfo.from_proto(reply)

    def health(self, service: str = "", *, timeout: Timeout = UNSET) -> bool:
        """True if the standard grpc.health.v1 service reports SERVING ("" = the whole server)."""
        reply = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _unary(self, method: Callable[..., _Resp], request: Any, timeout: Timeout) -> _Resp:
        deadline = Deadline(self._seconds(timeout))
        for attempt in itertools.count(1):
            try:
                return method(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as err:
                self._backoff_or_raise(err, attempt, deadline)
        raise AssertionError("unreachable")

    def _stream(self, stream: ResumableStream, timeout: float | None) -> Iterator[Delta]:
        deadline, attempt = Deadline(timeout), 1
        while not stream.finished:
            call, msg, attempt = self._open_stream(stream.request(), deadline, attempt)
            try:
                while msg is not None:
                    yield stream.take(msg)
                    msg = next(call, None)
            except grpc.RpcError as err:  # after the first message: resumed where that repeats no output
                if stream.finished:  # the final message came before the break: the output is whole
                    return
                stream.check_resumable(err)
                self._backoff_or_raise(err, attempt, deadline)
                attempt += 1
            else:
                stream.check_finished()
            finally:
                call.cancel()  # no-op once complete; stops the server's work if the caller stopped early

    def _open_stream(
        self, request: pb.GenerateRequest, deadline: Deadline, first: int
    ) -> tuple[Any, pb.GenerateResponse | None, int]:
        """Start Generate and wait for its first message, retrying while nothing has arrived; with the attempt
        it took (attempts count over a whole stream, its resumptions included)."""
        for attempt in itertools.count(first):
            call = self._stub.Generate(request, timeout=deadline.remaining(), metadata=self._metadata)
            try:
                return call, next(call, None), attempt
            except grpc.RpcError as err:
                self._backoff_or_raise(err, attempt, deadline)
        raise AssertionError("unreachable")

    def _backoff_or_raise(self, err: grpc.RpcError, attempt: int, deadline: Deadline) -> None:
        delay = retry_delay(self._retry, err, attempt, deadline)
        if delay is None:
            raise MineDraftError.from_rpc_error(err) from err
        time.sleep(delay)
