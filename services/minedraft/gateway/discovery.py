"""Engine groups discovered from a Kubernetes Service's EndpointSlices (a watch, not a poll).

The schedulers' Service (headless or not) lists one endpoint per scheduler pod; Kubernetes marks an
endpoint ready from the pod's readiness probe. The gateway routes to the ready ones and watches the
group's own health besides (a scheduler turns NOT_SERVING before its probe notices).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from kubernetes import client, config, watch

from minedraft.gateway.pool import Pool

log = logging.getLogger("minedraft.gateway")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_WATCH_TIMEOUT_S = 300  # the server ends a watch after this; it is then resumed from the last version
_RETRY_S = 2.0
METRICS_PORT_NAME = "metrics"


def load_api_client() -> client.ApiClient:
    """In a pod: its service account; elsewhere: the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def slice_addresses(endpoint_slice, port_name: str) -> dict[str, str | None]:
    """host:port of every ready endpoint of one EndpointSlice, on the port named `port_name`, with the
    scheduler's /metrics URL when the slice has a port named "metrics"."""
    ports = {p.name: p.port for p in endpoint_slice.ports or [] if p.port}
    if port_name not in ports:
        return {}
    addresses = {}
    for endpoint in endpoint_slice.endpoints or []:
        conditions = endpoint.conditions
        if conditions is not None and conditions.ready is False:  # unset means ready
            continue
        for host in endpoint.addresses or []:
            metrics = f"http://{_join(host, ports[METRICS_PORT_NAME])}/metrics" if METRICS_PORT_NAME in ports else None
            addresses[_join(host, ports[port_name])] = metrics
    return addresses


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EndpointSliceWatcher:
    """Keeps {slice name: ready addresses} of one Service and reports their union on every change."""

    def __init__(self, api: client.ApiClient, service: str, namespace: str, port_name: str,
                 on_addresses: Callable[[dict[str, str | None]], None]) -> None:  # fmt: skip
        self._discovery = client.DiscoveryV1Api(api)
        self._service = service
        self._namespace = namespace
        self._port_name = port_name
        self._on_addresses = on_addresses
        self._slices: dict[str, dict[str, str | None]] = {}
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None

    def run(self) -> None:
        """List, then watch from the list's version; start over after an error or an expired version."""
        while not self._stop.is_set():
            try:
                self._list_and_watch()
            except Exception as exc:  # the API server restarted, the version expired (410), a network error
                if self._stop.is_set():
                    return
                log.warning("watching the EndpointSlices of %s failed (%s); listing again in %.0fs",
                            self._service, exc, _RETRY_S)  # fmt: skip
                self._stop.wait(_RETRY_S)

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _list_and_watch(self) -> None:
        selector = f"{SERVICE_NAME_LABEL}={self._service}"
        listed = self._discovery.list_namespaced_endpoint_slice(self._namespace, label_selector=selector)
        self._slices = {s.metadata.name: slice_addresses(s, self._port_name) for s in listed.items}
        self._report()
        version = listed.metadata.resource_version
        while not self._stop.is_set():
            self._watch = watch.Watch()
            for event in self._watch.stream(
                self._discovery.list_namespaced_endpoint_slice, self._namespace, label_selector=selector,
                resource_version=version, timeout_seconds=_WATCH_TIMEOUT_S,
            ):  # fmt: skip
                version = self._apply(event)
            version = self._watch.resource_version or version

    def _apply(self, event: dict) -> str:
        endpoint_slice = event["object"]
        if event["type"] == "ERROR":
            raise RuntimeError(f"watch error: {endpoint_slice}")
        name = endpoint_slice.metadata.name
        if event["type"] == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = slice_addresses(endpoint_slice, self._port_name)
        self._report()
        return endpoint_slice.metadata.resource_version

    def _report(self) -> None:
        self._on_addresses({a: m for addresses in self._slices.values() for a, m in addresses.items()})


async def watch_endpoint_slices(
    pool: Pool, service: str, namespace: str, port_name: str, api: client.ApiClient | None = None
) -> None:
    """Feed `pool` with the ready schedulers of `service` until cancelled (the watch runs in a thread)."""
    loop = asyncio.get_running_loop()
    watcher = EndpointSliceWatcher(
        api or load_api_client(), service, namespace, port_name,
        lambda addresses: loop.call_soon_threadsafe(pool.set_addresses, addresses),
    )  # fmt: skip
    thread = threading.Thread(target=watcher.run, name="endpointslices", daemon=True)
    thread.start()
    try:
        await asyncio.Event().wait()
    finally:
        watcher.stop()
