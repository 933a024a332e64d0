"""A test double of the Kubernetes API server: EndpointSlices of one namespace, list and watch.

It speaks the API's HTTP shapes (an EndpointSliceList with a resourceVersion; a watch as a stream of
newline-delimited JSON events, from a given resourceVersion, ended after timeoutSeconds), so that the real
`kubernetes` Python client can talk to it. Only what the gateway's discovery uses is implemented.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

SERVICE_LABEL = "kubernetes.io/service-name"


def endpoint_slice(name: str, service: str, endpoints: list[tuple[str, bool]], port: int = 50051) -> dict:
    """An EndpointSlice object: (ip, ready) per endpoint, a named grpc port and a metrics port."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "ns", "labels": {SERVICE_LABEL: service}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in endpoints],
        "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}, {"name": "metrics", "port": 7450}],
    }


class KubernetesApiDouble:
    """Serve at `url`; `put` / `delete` change the slices and notify every open watch."""

    def __init__(self, namespace: str = "ns") -> None:
        self.namespace = namespace
        self.version = 1
        self.slices: dict[str, dict] = {}
        self.events: list[tuple[int, str, dict]] = []  # (resourceVersion, type, object)
        self.requests: list[str] = []  # paths with queries, in order
        self._changed = threading.Condition()
        self._generation = 0  # bumped by `drop_watches`
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.drop_watches()
        self._server.shutdown()
        self._server.server_close()

    def put(self, obj: dict) -> None:
        with self._changed:
            name = obj["metadata"]["name"]
            kind = "MODIFIED" if name in self.slices else "ADDED"
            self._record(kind, obj)
            self.slices[name] = obj

    def delete(self, name: str) -> None:
        with self._changed:
            self._record("DELETED", self.slices.pop(name))

    def drop_watches(self) -> None:
        """End every open watch, as an API server restart would; clients list and watch again."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def _record(self, kind: str, obj: dict) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.events.append((self.version, kind, json.loads(json.dumps(obj))))
        self._changed.notify_all()

    def _matching(self, selector: str) -> list[dict]:
        key, _, value = selector.partition("=")
        return [s for s in self.slices.values() if s["metadata"]["labels"].get(key) == value]

    def _handler(self):
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # a watch streams chunks, as the API server does

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                url = urlparse(self.path)
                double.requests.append(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                if url.path != f"/apis/discovery.k8s.io/v1/namespaces/{double.namespace}/endpointslices":
                    self._json(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
                elif query.get("watch") in ("true", "True", "1"):
                    self._watch(query)
                else:
                    with double._changed:
                        items = double._matching(query.get("labelSelector", ""))
                        body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                "metadata": {"resourceVersion": str(double.version)}, "items": items}  # fmt: skip
                    self._json(200, body)

            def _json(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)

            def _watch(self, query: dict) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    self._events(query)
                finally:
                    self._chunk(b"")  # the last chunk: the watch has ended

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _events(self, query: dict) -> None:
                since = int(query.get("resourceVersion") or 0)
                selector = query.get("labelSelector", "")
                key, _, value = selector.partition("=")
                end = time.monotonic() + float(query.get("timeoutSeconds", 300))
                with double._changed:
                    generation = double._generation
                while time.monotonic() < end:
                    with double._changed:
                        new = [e for e in double.events if e[0] > since]
                        if not new:
                            double._changed.wait(timeout=0.5)
                        if double._generation != generation:
                            return
                    for version, kind, obj in new:
                        since = version
                        if obj["metadata"]["labels"].get(key) == value:
                            self._chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        return Handler
