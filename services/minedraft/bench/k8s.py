"""`minedraft bench --k8s`: reach a release's public Service (its gateway) through a port-forward, then benchmark it.

    with port_forward("minedraft-gateway", "default") as target:   # "127.0.0.1:<free port>"
        run_online_bench(target, prompts, ...)

Two ways to forward: `kubectl port-forward svc/<service>` as a subprocess (the default: it uses the
user's kubeconfig, context and auth plugins exactly as kubectl does), or the `kubernetes` Python client's
pod port-forward behind a small local TCP relay (no kubectl needed). Either way the forward is closed when
the `with` block ends, also on errors and Ctrl-C.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

DEFAULT_NAMESPACE = "default"
DEFAULT_SERVICE = "minedraft-gateway"  # <release>-gateway with the release name "minedraft"
SCHEDULER_PORT = 50051
METHODS = ("kubectl", "client")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def port_forward(
    service: str = DEFAULT_SERVICE,
    namespace: str = DEFAULT_NAMESPACE,
    *,
    remote_port: int = SCHEDULER_PORT,
    method: str = "kubectl",
    local_port: int = 0,
    kubectl: str = "kubectl",
    timeout: float = 30.0,
) -> Iterator[str]:
    """Forward 127.0.0.1:<local_port> (0 = a free one) to port `remote_port` of a Service; yield host:port."""
    if method == "kubectl":
        forward = _kubectl_forward(service, namespace, remote_port, local_port or free_port(), kubectl, timeout)
    elif method == "client":
        forward = _client_forward(service, namespace, remote_port, local_port)
    else:
        raise ValueError(f"port-forward method must be one of {', '.join(METHODS)}, got {method!r}")
    with forward as address:
        yield address


# --- kubectl -------------------------------------------------------------------------------------------


def kubectl_command(kubectl: str, service: str, namespace: str, local_port: int, remote_port: int) -> list[str]:
    """The port-forward command line; --address keeps the forward off the machine's other interfaces."""
    return [
        kubectl, "port-forward", "--namespace", namespace, "--address", "127.0.0.1",
        f"svc/{service}", f"{local_port}:{remote_port}",
    ]  # fmt: skip


@contextlib.contextmanager
def _kubectl_forward(
    service: str, namespace: str, remote_port: int, local_port: int, kubectl: str, timeout: float
) -> Iterator[str]:
    command = kubectl_command(kubectl, service, namespace, local_port, remote_port)
    # kubectl prints a line per forwarded connection: into a file, since a pipe nobody drains would fill
    # up and stall the forward in the middle of a benchmark.
    with tempfile.TemporaryFile() as log:
        try:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{kubectl} not found: install kubectl, or use --port-forward client") from exc
        try:
            wait_for_port(local_port, timeout, lambda: _exit_message(process, log))
            yield f"127.0.0.1:{local_port}"
        finally:
            stop_process(process)


def _exit_message(process: subprocess.Popen, log: BinaryIO) -> str | None:
    """None while kubectl runs; once it exited, why (its own output)."""
    if process.poll() is None:
        return None
    log.seek(0)
    output = log.read().decode(errors="replace").strip()
    return f"kubectl port-forward exited with code {process.returncode}: {output or '(no output)'}"


def wait_for_port(port: int, timeout: float, failed: Callable[[], str | None], host: str = "127.0.0.1") -> None:
    """Block until host:port accepts a TCP connection; raise if `failed()` reports a reason or on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        reason = failed()
        if reason is not None:
            raise ConnectionError(reason)
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the port-forward did not open {host}:{port} within {timeout:.0f}s")
        time.sleep(0.1)


def stop_process(process: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; always reaps the process."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- kubernetes Python client --------------------------------------------------------------------------


def resolve_service_pod(api: Any, service: str, namespace: str, port: int) -> tuple[str, int]:
    """(pod name, container port) behind port `port` of a Service, as `kubectl port-forward svc/...` picks it:
    a running pod matched by the Service's selector, ready ones first."""
    svc = api.read_namespaced_service(service, namespace)
    service_port = next((p for p in svc.spec.ports or [] if p.port == port), None)
    if service_port is None:
        known = ", ".join(str(p.port) for p in svc.spec.ports or []) or "none"
        raise LookupError(f"service {namespace}/{service} has no port {port} (ports: {known})")
    if not svc.spec.selector:
        raise LookupError(f"service {namespace}/{service} has no selector: no pod to forward to")
    selector = ",".join(f"{k}={v}" for k, v in sorted(svc.spec.selector.items()))
    pods = api.list_namespaced_pod(namespace, label_selector=selector).items
    running = [p for p in pods if p.status.phase == "Running"]
    if not running:
        raise LookupError(f"no running pod behind service {namespace}/{service} (selector {selector})")
    pod = sorted(running, key=lambda p: (not _is_ready(p), p.metadata.name))[0]
    return pod.metadata.name, _container_port(pod, service_port.target_port or port)


def _is_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _container_port(pod: Any, target: int | str) -> int:
    """A Service's targetPort is a number or the name of a container port."""
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in pod.spec.containers:
        for p in container.ports or []:
            if p.name == target:
                return p.container_port
    raise LookupError(f"pod {pod.metadata.name} has no container port named {target!r}")


def _core_api() -> Any:
    from kubernetes import client, config

    try:
        config.load_kube_config()
    except config.ConfigException:
        config.load_incluster_config()  # running inside a pod
    return client.CoreV1Api()


@contextlib.contextmanager
def _client_forward(service: str, namespace: str, remote_port: int, local_port: int) -> Iterator[str]:
    from kubernetes.stream import portforward

    api = _core_api()
    pod, pod_port = resolve_service_pod(api, service, namespace, remote_port)

    def connect() -> socket.socket:
        # One websocket per TCP connection; the returned socket's peer end is driven by the client's thread.
        forward = portforward(api.connect_get_namespaced_pod_portforward, pod, namespace, ports=str(pod_port))
        return forward.socket(pod_port)

    with TcpRelay(connect, local_port) as port:
        yield f"127.0.0.1:{port}"


class TcpRelay:
    """Listen on 127.0.0.1:port; pipe every accepted connection to a fresh `connect()` socket, both ways."""

    def __init__(self, connect: Callable[[], socket.socket], port: int = 0) -> None:
        self._connect = connect
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()

    def __enter__(self) -> int:
        self._spawn(self._accept_loop)
        return self.port

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        _shutdown(self._listener)  # shutdown, not just close: it wakes the thread blocked in accept()
        with self._lock:
            for s in self._sockets:
                _shutdown(s)
        for thread in self._threads:
            thread.join(timeout=5)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:  # the listener was closed
                return
            try:
                upstream = self._connect()
            except Exception:  # a failed forward drops this connection, not the relay
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            self._spawn(_pump, client, upstream)
            self._spawn(_pump, upstream, client)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy src -> dst until EOF or an error, then close both directions of both."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        _shutdown(src)
        _shutdown(dst)


def _shutdown(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()
