"""The gRPC server every service runs: message limits, the services' names, health and reflection, its port."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from minedraft.api import generate_pb2, worker_pb2
from minedraft.settings import ListenError

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
PUBLIC_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["MineDraft"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a plan admitting many long prompts can be large


def grpc_options(server: bool = False) -> list[tuple[str, int]]:
    """The options of every channel between our services (`server`: of their servers)."""
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    if server:  # a port already in use must fail, not be silently shared with another process
        return [*options, ("grpc.so_reuseport", 0)]
    # A peer that died comes back within seconds (restarted by `up` or the kubelet): reconnect at least once a
    # second, where gRPC's default backoff grows to two minutes over a long outage (a drafter down for two
    # minutes was then seen serving again only a minute after its restart).
    return [*options, ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000)]


def add_health_and_reflection(server, health_servicer, service_name: str) -> None:
    """Register grpc.health.v1 (NOT_SERVING until `health.set_status`) and server reflection."""
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([service_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)


def listen(server, address: str, flag: str, credentials=None) -> int:
    """Listen on `address`; ListenError naming `flag` if that fails (grpc raises or returns 0, by version)."""
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ListenError(flag, address)
    return bound
