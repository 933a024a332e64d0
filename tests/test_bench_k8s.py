"""`minedraft bench --k8s`: the port-forward context manager, against a kubectl test double and fakes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_kubectl import pid_alive, recorded, write_fake_kubectl

from minedraft.bench.k8s import TcpRelay, kubectl_command, port_forward, resolve_service_pod
from minedraft.cli import build_parser


@contextlib.contextmanager
def echo_server() -> Iterator[int]:
    """A TCP server that echoes every connection (the 'pod' behind the forward)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        server.close()


def roundtrip(address: str, payload: bytes = b"minedraft") -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(payload)
        received = b""
        while len(received) < len(payload):
            received += conn.recv(65536)
        return received


@pytest.fixture
def fake_kubectl(tmp_path, monkeypatch):
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_KUBECTL_RECORD", str(record))
    return write_fake_kubectl(tmp_path), record


def test_kubectl_forward_starts_awaits_and_cleans_up(fake_kubectl, monkeypatch) -> None:
    kubectl, record = fake_kubectl
    with echo_server() as upstream:
        monkeypatch.setenv("FAKE_KUBECTL_UPSTREAM", str(upstream))
        with port_forward("minedraft-scheduler", "serving", kubectl=str(kubectl), timeout=20) as address:
            port = int(address.rsplit(":", 1)[1])
            # The port was awaited: it accepts connections as soon as the context is entered.
            assert roundtrip(address) == b"minedraft"
            assert roundtrip(address, b"x" * 100_000) == b"x" * 100_000
            call = recorded(record)
            assert call["argv"] == kubectl_command(str(kubectl), "minedraft-scheduler", "serving", port, 50051)[1:]
            assert pid_alive(call["pid"])
    assert not pid_alive(call["pid"]), "kubectl port-forward must be stopped when the block ends"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_kubectl_forward_is_cleaned_up_when_the_body_raises(fake_kubectl, monkeypatch) -> None:
    kubectl, record = fake_kubectl
    with echo_server() as upstream:
        monkeypatch.setenv("FAKE_KUBECTL_UPSTREAM", str(upstream))
        with pytest.raises(KeyboardInterrupt), port_forward(kubectl=str(kubectl), timeout=20):
            raise KeyboardInterrupt
    assert not pid_alive(recorded(record)["pid"])


def test_kubectl_failure_is_reported_with_its_message(fake_kubectl, monkeypatch) -> None:
    kubectl, record = fake_kubectl
    monkeypatch.setenv("FAKE_KUBECTL_MODE", "fail")
    started = time.monotonic()
    with (
        pytest.raises(ConnectionError, match='services "minedraft-scheduler" not found'),
        port_forward(kubectl=str(kubectl), timeout=20),
    ):
        pytest.fail("the body must not run")
    assert time.monotonic() - started < 10, "an exited kubectl must fail fast, not wait for the timeout"


def test_kubectl_that_never_listens_times_out_and_is_killed(fake_kubectl, monkeypatch) -> None:
    kubectl, record = fake_kubectl
    monkeypatch.setenv("FAKE_KUBECTL_MODE", "hang")
    with pytest.raises(TimeoutError), port_forward(kubectl=str(kubectl), timeout=1):
        pytest.fail("the body must not run")
    assert not pid_alive(recorded(record)["pid"])


def test_missing_kubectl_says_what_to_do(tmp_path) -> None:
    with (
        pytest.raises(FileNotFoundError, match="--port-forward client"),
        port_forward(kubectl=str(tmp_path / "no-kubectl")),
    ):
        pytest.fail("the body must not run")


def test_unknown_method_is_rejected() -> None:
    with pytest.raises(ValueError, match="kubectl, client"), port_forward(method="ssh"):
        pass


def test_tcp_relay_pipes_each_connection_to_a_new_upstream() -> None:
    connects = []
    with echo_server() as upstream:

        def connect() -> socket.socket:
            connects.append(1)
            return socket.create_connection(("127.0.0.1", upstream))

        with TcpRelay(connect) as port:
            assert roundtrip(f"127.0.0.1:{port}") == b"minedraft"
            assert roundtrip(f"127.0.0.1:{port}", b"y" * 200_000) == b"y" * 200_000
        assert len(connects) == 2
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()


def _pod(name: str, phase: str = "Running", ready: bool = True, ports=()) -> SimpleNamespace:
    return SimpleNamespace(
        metadata=SimpleNamespace(name=name),
        status=SimpleNamespace(phase=phase, conditions=[SimpleNamespace(type="Ready", status=str(ready))]),
        spec=SimpleNamespace(
            containers=[SimpleNamespace(ports=[SimpleNamespace(name=n, container_port=p) for n, p in ports])]
        ),
    )


class FakeCoreApi:
    """The two CoreV1Api calls resolve_service_pod makes, over fixed objects."""

    def __init__(self, target_port, pods) -> None:
        self.service = SimpleNamespace(
            spec=SimpleNamespace(
                ports=[SimpleNamespace(port=50051, target_port=target_port)],
                selector={"app.kubernetes.io/component": "scheduler", "app.kubernetes.io/instance": "minedraft"},
            )
        )
        self.pods = pods
        self.selectors: list[str] = []

    def read_namespaced_service(self, name: str, namespace: str):
        return self.service

    def list_namespaced_pod(self, namespace: str, label_selector: str):
        self.selectors.append(label_selector)
        return SimpleNamespace(items=self.pods)


def test_client_method_resolves_a_ready_pod_and_a_named_target_port() -> None:
    pods = [
        _pod("a-pending", phase="Pending"),
        _pod("b-unready", ready=False, ports=[("grpc", 50051)]),
        _pod("c-ready", ports=[("grpc", 6000), ("metrics", 7450)]),
    ]
    api = FakeCoreApi("grpc", pods)
    assert resolve_service_pod(api, "minedraft-scheduler", "default", 50051) == ("c-ready", 6000)
    assert api.selectors == ["app.kubernetes.io/component=scheduler,app.kubernetes.io/instance=minedraft"]


def test_client_method_explains_what_is_missing() -> None:
    with pytest.raises(LookupError, match="has no port 50052"):
        resolve_service_pod(FakeCoreApi(50051, [_pod("p")]), "s", "default", 50052)
    with pytest.raises(LookupError, match="no running pod"):
        resolve_service_pod(FakeCoreApi(50051, [_pod("p", phase="Pending")]), "s", "default", 50051)


def test_cli_k8s_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", "--k8s", "--namespace", "prod", "--service", "md-scheduler"])
    assert (args.k8s, args.namespace, args.service, args.port_forward) == (True, "prod", "md-scheduler", "kubectl")
    assert parser.parse_args(["bench", "--k8s", "--port-forward", "client"]).port_forward == "client"
    with pytest.raises(SystemExit):  # one way to benchmark at a time
        parser.parse_args(["bench", "--k8s", "--target", "127.0.0.1:50051"])
