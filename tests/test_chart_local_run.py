"""The chart's cpu profile, run as local processes exactly as its pods are specified.

Each Deployment's container args and environment come from the rendered manifests (ConfigMap references
resolved from the rendered ConfigMap), so a wrong variable name, port or address in the chart breaks this
test the way it would break the pods. Greedy output over the wire must equal the bundled target's offline
autoregressive output. Then `minedraft bench --k8s` runs against the same processes through a kubectl
test double.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from fake_kubectl import recorded, write_fake_kubectl
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.cli import main
from minedraft.client import Client
from minedraft.config import BUNDLED_DRAFT, BUNDLED_TARGET
from minedraft.stack.local import free_port

from conftest import require_weights

ROOT = Path(__file__).resolve().parents[1]

IMAGE_ENTRYPOINT = ["minedraft"]  # docker/Dockerfile.cpu's ENTRYPOINT; the pods give only args
START_ORDER = ("verifier", "drafter", "scheduler")
PORT_FLAGS = ("--port", "--metrics-port", "--dist-port")
PROMPT = "def read_config(path):"


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_manifests", ROOT / "scripts" / "render_manifests.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_manifests"] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class LocalPod:
    """One pod's container as a local process: argv and environment."""

    name: str
    argv: list[str]
    env: dict[str, str]


def render_cpu_profile() -> list[dict]:
    renderer = _load_renderer()
    return [m.obj for m in renderer.render(renderer.profile_values("cpu"))]


def _deployments(objs: list[dict]) -> dict[str, dict]:
    """The engine group's Deployments. Not the gateway: it discovers the schedulers through the Kubernetes
    API (tests/test_gateway_discovery.py runs that against an API double) and shares the scheduler's port."""
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    by_component = {o["metadata"]["labels"]["app.kubernetes.io/component"]: o for o in deployments}
    by_component.pop("gateway", None)
    return by_component


def _service_hosts(objs: list[dict]) -> set[str]:
    """Every DNS form of every Service of the release."""
    hosts = set()
    for obj in objs:
        if obj["kind"] == "Service":
            name = obj["metadata"]["name"]
            hosts |= {name, f"{name}.default", f"{name}.default.svc", f"{name}.default.svc.cluster.local"}
    return hosts


def _port_map(objs: list[dict]) -> dict[int, int]:
    """Container port -> a free local port.

    Every pod has its own network namespace, so in a cluster two pods could listen on the same number;
    here all processes share one machine. One map from number to local port is right because the chart
    gives every container port a distinct number and every Service port equals its target container port;
    both are asserted, so a chart change that breaks the premise fails loudly instead of silently.
    """
    container_ports: dict[str, int] = {}
    for deployment in _deployments(objs).values():
        for port in deployment["spec"]["template"]["spec"]["containers"][0].get("ports", []):
            container_ports.setdefault(port["name"] + "@" + deployment["metadata"]["name"], port["containerPort"])
    numbers = list(container_ports.values())
    assert len(numbers) == len(set(numbers)), f"container ports collide on one machine: {container_ports}"
    for obj in objs:
        if obj["kind"] == "Service":
            for port in obj["spec"]["ports"]:
                assert port["port"] in numbers, f"{obj['metadata']['name']}: port {port['port']} != container port"
    return {number: free_port() for number in numbers}


def _container_env(objs: list[dict], container: dict) -> dict[str, str]:
    """envFrom ConfigMaps, then env entries; secretKeyRef/fieldRef entries are skipped (no cluster here)."""
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "configMapKeyRef" in entry.get("valueFrom", {}):
            ref = entry["valueFrom"]["configMapKeyRef"]
            env[entry["name"]] = configmaps[ref["name"]][ref["key"]]
    return env


def _localize_value(name: str, value: str, hosts: set[str], ports: dict[int, int], scratch: Path) -> str:
    """Service DNS names -> 127.0.0.1, container ports -> local ports, the pod's /tmp -> its own folder."""
    host, _, port = value.rpartition(":")
    if host in hosts and port.isdigit():
        return f"127.0.0.1:{ports[int(port)]}"
    if value in hosts:
        return "127.0.0.1"
    if name.endswith("_PORT") and value.isdigit() and int(value) in ports:
        return str(ports[int(value)])
    if value == "/tmp" or value.startswith("/tmp/"):
        return str(scratch) + value[len("/tmp") :]
    return value


def local_pods(objs: list[dict], tmp_path: Path) -> tuple[dict[str, LocalPod], dict[int, int]]:
    hosts, ports = _service_hosts(objs), _port_map(objs)
    pods = {}
    for component, deployment in _deployments(objs).items():
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        command = container.get("command", IMAGE_ENTRYPOINT)
        assert command == IMAGE_ENTRYPOINT, f"{component}: unexpected command {command}"
        args = list(container["args"])
        for i in range(1, len(args)):
            if args[i - 1] in PORT_FLAGS:
                args[i] = str(ports[int(args[i])])
        scratch = tmp_path / component
        scratch.mkdir()
        env = {k: _localize_value(k, v, hosts, ports, scratch) for k, v in _container_env(objs, container).items()}
        # A pod listens on all interfaces of its own network namespace; here that would be the shared machine's.
        env["MINEDRAFT_HOST"] = "127.0.0.1"
        pods[component] = LocalPod(component, [sys.executable, "-m", "minedraft", *args], env)
    return pods, ports


def _process_env(pod_env: dict[str, str]) -> dict[str, str]:
    """This test process's environment (PATH, OMP_NUM_THREADS, ...) without MINEDRAFT_*, then the pod's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINEDRAFT_")}
    env.update(pod_env)
    return env


def _wait_serving(address: str, processes: dict[str, subprocess.Popen], logs: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            for name, process in processes.items():
                if process.poll() is not None:
                    pytest.fail(f"the {name} exited with code {process.returncode}:\n{_tails(logs)}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the scheduler did not report SERVING within {timeout:.0f}s:\n{_tails(logs)}")
            time.sleep(0.25)


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log")))


def _stop(processes: dict[str, subprocess.Popen]) -> None:
    """SIGTERM in reverse start order (scheduler first), then SIGKILL whatever did not exit."""
    for process in reversed(processes.values()):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in reversed(processes.values()):
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def expected_tokens() -> list[int]:
    """The bundled target's offline autoregressive output: what every mode must reproduce."""
    from minedraft import LLM, SamplingParams

    require_weights(BUNDLED_TARGET, BUNDLED_DRAFT)
    llm = LLM(model=None)
    try:
        return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    finally:
        llm.close()


def test_cpu_profile_runs_as_rendered(tmp_path, expected_tokens, monkeypatch, capsys) -> None:
    objs = render_cpu_profile()
    pods, ports = local_pods(objs, tmp_path)
    scheduler_port = ports[50051]
    logs = tmp_path / "logs"
    logs.mkdir()
    processes: dict[str, subprocess.Popen] = {}
    try:
        for name in START_ORDER:
            with open(logs / f"{name}.log", "w") as log:
                processes[name] = subprocess.Popen(
                    pods[name].argv, env=_process_env(pods[name].env), stdout=log, stderr=subprocess.STDOUT
                )
        _wait_serving(f"127.0.0.1:{scheduler_port}", processes, logs, timeout=240)

        with Client(f"127.0.0.1:{scheduler_port}", timeout=120) as client:
            completion = client.generate(PROMPT, max_tokens=16, temperature=0)
            info = client.server_info()
        assert completion.token_ids == expected_tokens, _tails(logs)
        assert info.mode == "minedraft" and info.tensor_parallel_size == 1

        # `minedraft bench --k8s` against the same stack: the kubectl test double relays its port-forward.
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        write_fake_kubectl(bin_dir)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("FAKE_KUBECTL_RECORD", str(tmp_path / "kubectl.json"))
        monkeypatch.setenv("FAKE_KUBECTL_UPSTREAM", str(scheduler_port))
        dataset = tmp_path / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (PROMPT, "import os\n")))
        argv = ["bench", "--k8s", "--service", "minedraft-scheduler", "--dataset", str(dataset), "--max-tokens", "8",
                "--concurrency", "2", "--warmup", "0"]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr()
        assert recorded(tmp_path / "kubectl.json")["argv"][:6] == [
            "port-forward", "--namespace", "default", "--address", "127.0.0.1", "svc/minedraft-scheduler",
        ]  # fmt: skip
        assert "forwarding 127.0.0.1:" in capsys.readouterr().out
    finally:
        _stop(processes)
