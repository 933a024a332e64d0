"""Blocking client over a grpc channel."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.api import generate_pb2 as pb
from minedraft.api import generate_pb2_grpc
from minedraft.client._common import (
    UNSET,
    ChannelOptions,
    Prompt,
    ResumableStream,
    Timeout,
    Tls,
    build_generate_request,
    call_metadata,
    channel_credentials,
    channel_options,
    completion_from_deltas,
    incomplete_stream_error,
    resolve_timeout,
)
from minedraft.client.retry import DEFAULT_RETRY_POLICY, Deadline, RetryPolicy, retry_delay
from minedraft.client.types import Completion, Delta, MineDraftError, ServerInfo

_Resp = TypeVar("_Resp")


class Client:
    """Blocking client of a MineDraft server. Thread-safe; one channel per client.

    `tls`: None/False plaintext, True TLS with the system roots, a `grpc.ChannelCredentials`, or the path
    of a PEM root certificate. `token` is sent as `authorization: Bearer <token>` on every call. `timeout`
    is the default deadline of a call in seconds (None: none), covering all of its retries. `retries`: a
    RetryPolicy, or the number of retries after the first attempt (0/None: none); UNAVAILABLE only.
    """

    def __init__(
        self,
        target: str,
        *,
        tls: Tls = None,
        token: str | None = None,
        timeout: float | None = None,
        retries: RetryPolicy | int | None = DEFAULT_RETRY_POLICY,
        options: ChannelOptions | None = None,
    ) -> None:
        creds = channel_credentials(tls)
        opts = channel_options(options)
        self._channel = (
            grpc.insecure_channel(target, opts) if creds is None else grpc.secure_channel(target, creds, opts)
        )
        self._stub = generate_pb2_grpc.MineDraftStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = call_metadata(token)
        self._timeout = timeout
        self._retry = RetryPolicy.coerce(retries)

    def generate(self, prompt: Prompt, **arguments: Any) -> Completion:
        """Generate a completion: the concatenated deltas of `stream`, which takes the same arguments."""
        return completion_from_deltas(self.stream(prompt, **arguments))

    def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        request_id: str | None = None,
        lora: str | None = None,
        timeout: Timeout = UNSET,
        **options: Any,
    ) -> Iterator[Delta]:
        """Stream a completion as Deltas; the RPC starts at the first `next`, and stopping early cancels it."""
        request = build_generate_request(
            prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, request_id=request_id, lora=lora, **options,
        )  # fmt: skip
        return self._stream(request, resolve_timeout(timeout, self._timeout))

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
        deadline = Deadline(resolve_timeout(timeout, self._timeout))
        for attempt in itertools.count(1):
            try:
                return method(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as err:
                self._backoff_or_raise(err, attempt, deadline)
        raise AssertionError("unreachable")

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Iterator[Delta]:
        deadline, stream, attempt = Deadline(timeout), ResumableStream(request, self._retry), 1
        while True:
            call, msg, attempt = self._open_stream(stream.request(), deadline, attempt)
            try:
                while msg is not None:
                    yield stream.take(msg)
                    msg = next(call, None)
            except grpc.RpcError as err:  # after the first message: resumed where that repeats no output
                if not stream.may_resume():
                    raise MineDraftError.from_rpc_error(err) from err
                self._backoff_or_raise(err, attempt, deadline)
                attempt += 1
                continue
            finally:
                call.cancel()  # no-op once complete; stops the server's work if the caller stopped early
            if not stream.finished:
                raise incomplete_stream_error()
            return

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
