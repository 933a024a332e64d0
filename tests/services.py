"""Helpers for tests that start services as processes: health checks and waits, worker info, children,
HTTP posts and bursts of requests."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.api import worker_pb2, worker_pb2_grpc
from minedraft.client import Client
from minedraft.service.health import is_serving
from minedraft.settings import WorkerSettings
from minedraft.stack.fork_server import launch_service
from minedraft.stack.local import free_port

# Workers that exit as soon as they are told to. A stack stops its scheduler first and waits for it to drain and
# exit, so a worker's own wait on SIGTERM (step_drain_timeout: until no step has come for a second) only waits there.
# tests/test_drain_supervision.py, which tests the drain, keeps the default.
QUICK_STOP = WorkerSettings(step_drain_timeout=0)
# A drafter service beside the verifier, as pods run them (on CPU a stack colocates both models by default).
TWO_PROCESSES = QUICK_STOP.model_copy(update={"colocate_drafter": False})


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
        time.sleep(0.05)


def wait_health(address: str, want: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (status := health(address)) != want:
        assert time.monotonic() < deadline, f"{address} is {status}, not {want}"
        time.sleep(0.05)


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


@contextmanager
def gateway(backend: str, tokenizer: str, log_path: Path) -> Iterator[str]:
    """`minedraft gateway` in front of one scheduler, as a process; yields its address once it serves."""
    port = free_port()
    command = [sys.executable, "-m", "minedraft", "gateway", "--tokenizer", tokenizer, "--host", "127.0.0.1",
               "--port", str(port), "--backend", backend]  # fmt: skip
    process = launch_service(command, dict(os.environ), log_path, forkable=True)  # as the stacks start theirs
    try:
        deadline = time.monotonic() + 120
        while not serving(f"127.0.0.1:{port}", timeout_s=1):
            assert process.poll() is None and time.monotonic() < deadline, f"the gateway did not start: {log_path}"
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def post_json(url: str, body: bytes, timeout_s: float = 120) -> tuple[int, bytes]:
    """POST a JSON body; (status, raw response body) for errors too."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post_for_json(url: str, body: bytes) -> tuple[int, dict]:
    """POST a JSON body; (status, the JSON reply) for errors too."""
    status, raw = post_json(url, body)
    return status, json.loads(raw)


def overload_codes(address: str, n: int = 40) -> list[str]:
    """`n` long greedy requests at once over gRPC: "ok" for each that ran, else its status code's name."""
    with Client(address, timeout=120, retries=0) as client:

        def one(_: int) -> str:
            try:
                client.generate([9, 9], max_tokens=100, temperature=0, ignore_eos=True)
                return "ok"
            except grpc.RpcError as exc:
                return exc.code().name

        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(one, range(n)))
