"""API keys for both public protocols: `authorization: Bearer <key>` as HTTP header or gRPC metadata.

Health checks, reflection and metrics stay open (probes and Prometheus carry no key); everything that
generates or describes the served model needs a key once any is configured.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path

import grpc

API_KEYS_ENV = "MINEDRAFT_API_KEYS"  # comma- or newline-separated, as a Kubernetes Secret can provide them


class ApiKeys:
    """The accepted keys; empty means authentication is off."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [k.encode() for k in keys if k]

    @classmethod
    def load(cls, keys: Iterable[str] = (), files: Iterable[str | os.PathLike] = (), env: bool = True) -> ApiKeys:
        """Keys given directly, one per line in each file, and from $MINEDRAFT_API_KEYS."""
        found = list(keys)
        for file in files:
            found += _split(Path(file).read_text(encoding="utf-8"))
        if env:
            found += _split(os.environ.get(API_KEYS_ENV, ""))
        return cls(found)

    @property
    def keys(self) -> list[str]:
        return [k.decode() for k in self._keys]

    def allows(self, authorization: str | None) -> bool:
        """True if off, or if `authorization` is 'Bearer <a configured key>' (constant-time compare)."""
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        given = token.strip().encode()
        return any(hmac.compare_digest(given, key) for key in self._keys)


def _split(text: str) -> list[str]:
    return [k.strip() for k in text.replace(",", "\n").splitlines() if k.strip()]


class GrpcAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls to `protected_services` without a valid key in their metadata."""

    def __init__(self, keys: ApiKeys, protected_services: Iterable[str]) -> None:
        self._keys = keys
        self._prefixes = tuple(f"/{name}/" for name in protected_services)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefixes):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self._keys.allows(metadata.get("authorization")):
            return handler
        return _refusing(handler)


_MESSAGE = "missing or invalid API key: send 'authorization: Bearer <key>' metadata"


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)
        yield  # pragma: no cover (makes this an async generator, as a streaming handler must be)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
