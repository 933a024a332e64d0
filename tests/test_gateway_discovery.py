"""The gateway's backends from a Service's EndpointSlices: the real `kubernetes` client (list, then watch)
against a local test double of the Kubernetes API (no cluster runs here)."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import parse_qs, urlparse

import pytest
from k8s_api_double import KubernetesApiDouble, endpoint_slice
from kubernetes import client

from minedraft.gateway.discovery import watch_endpoint_slices
from minedraft.gateway.pool import Pool


@pytest.fixture
def api_double():
    double = KubernetesApiDouble()
    yield double
    double.close()


def _api_client(url: str) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = url
    return client.ApiClient(configuration)


async def _until(pool: Pool, expected: set[str], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while set(pool.backends) != expected:
        assert time.monotonic() < deadline, f"backends {set(pool.backends)}, expected {expected}"
        await asyncio.sleep(0.05)


def test_backends_follow_the_ready_endpoints_of_the_service(api_double) -> None:
    api_double.put(endpoint_slice("sched-a", "minedraft-scheduler", [("10.0.0.1", True), ("10.0.0.2", True)]))
    api_double.put(endpoint_slice("other", "another-service", [("10.9.9.9", True)]))

    async def scenario() -> None:
        pool = Pool()
        task = asyncio.create_task(
            watch_endpoint_slices(pool, "minedraft-scheduler", "ns", "grpc", api=_api_client(api_double.url))
        )
        try:
            await _until(pool, {"10.0.0.1:50051", "10.0.0.2:50051"})  # listed; the other Service is not ours
            assert pool.backends["10.0.0.1:50051"].metrics_url == "http://10.0.0.1:7450/metrics"  # its queue
            api_double.put(endpoint_slice("sched-b", "minedraft-scheduler", [("10.0.1.1", True), ("10.0.1.2", False)]))
            await _until(pool, {"10.0.0.1:50051", "10.0.0.2:50051", "10.0.1.1:50051"})  # watched: only ready ones
            api_double.put(endpoint_slice("sched-a", "minedraft-scheduler", [("10.0.0.1", True), ("10.0.0.2", False)]))
            await _until(pool, {"10.0.0.1:50051", "10.0.1.1:50051"})  # a pod no longer ready
            api_double.delete("sched-b")
            await _until(pool, {"10.0.0.1:50051"})
            api_double.drop_watches()  # the API server restarts: the client lists and watches again
            api_double.put(endpoint_slice("sched-c", "minedraft-scheduler", [("10.0.2.1", True)], port=6000))
            await _until(pool, {"10.0.0.1:50051", "10.0.2.1:6000"})
            assert not any(b.serving for b in pool.backends.values())  # nothing listens there: skipped
        finally:
            task.cancel()
            await pool.close()

    asyncio.run(scenario())
    queries = [parse_qs(urlparse(r).query) for r in api_double.requests]
    watches = [q for q in queries if q.get("watch") == ["true"]]
    assert len(watches) >= 2  # the first watch, and the one after the restart
    assert all(q["labelSelector"] == ["kubernetes.io/service-name=minedraft-scheduler"] for q in queries)
    assert all(q.get("resourceVersion") for q in watches)  # a watch resumes from a version, never replays all


def test_a_slice_without_the_named_port_contributes_nothing(api_double) -> None:
    api_double.put(endpoint_slice("sched-a", "minedraft-scheduler", [("10.0.0.1", True)]))

    async def scenario() -> None:
        pool = Pool()
        task = asyncio.create_task(
            watch_endpoint_slices(pool, "minedraft-scheduler", "ns", "http", api=_api_client(api_double.url))
        )
        await asyncio.sleep(1.0)
        assert pool.backends == {}
        task.cancel()
        await pool.close()

    asyncio.run(scenario())
