"""grpc.health.v1 as the services use it: whether a peer serves, and a service's own status."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.service.grpc_server import PUBLIC_SERVICE


def is_serving(channel: grpc.Channel, timeout_s: float = 2.0) -> bool:
    """Whether the server behind `channel` answers its health check with SERVING (not answering: False)."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def probe(address: str, credentials: grpc.ChannelCredentials | None = None, timeout_s: float = 1.0) -> bool:
    """`is_serving` on a channel of its own: a launcher waiting for a service it just started asks again and
    again, and a kept channel would wait out its reconnect backoff after each refused connection."""
    with grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address) as channel:
        return is_serving(channel, timeout_s)


def set_status(health_servicer, service_name: str, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", service_name):
        health_servicer.set(name, status)


async def set_public_status(health_servicer, serving: bool) -> None:
    """`set_status` for the public API's asyncio health servicer (scheduler and gateway)."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", PUBLIC_SERVICE):
        await health_servicer.set(name, status)
