"""Helpers for tests that start services as processes: health checks and waits, worker info, children."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.api import worker_pb2, worker_pb2_grpc
from minedraft.serving import is_serving


def serving(address: str, timeout_s: float = 2.0) -> bool:
    """Whether the service at `address` answers its health check with SERVING."""
    with grpc.insecure_channel(address) as channel:
        return is_serving(channel, timeout_s=timeout_s)


def health(address: str) -> str:
    """The health status's name (SERVING, NOT_SERVING), or the gRPC code's name when the check fails."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_serving(address: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not serving(address, timeout_s=1):
        assert time.monotonic() < deadline, f"{address} is {health(address)}, not SERVING after {timeout_s:.0f}s"
        time.sleep(0.2)


def wait_health(address: str, want: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (status := health(address)) != want:
        assert time.monotonic() < deadline, f"{address} is {status}, not {want}"
        time.sleep(0.2)


def worker_info(address: str) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=10)


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc/<pid>/stat: the field after the command's closing paren)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
