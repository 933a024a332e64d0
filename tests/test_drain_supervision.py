"""Failures of real processes: scheduler loss, a hung worker, draining on SIGTERM, supervision by
`minedraft up`. Every service is a separate process started with the command a pod runs; failures are
real signals (SIGKILL, SIGSTOP, SIGTERM)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.engine.engine import LLMEngine
from minedraft.sampling.params import SamplingParams
from minedraft.scheduler.step_deadline import StepDeadline
from minedraft.service.lifetime import supervised_child
from minedraft.stack.local import engine_flags, free_port

from conftest import tiny_config
from services import children, wait_health, wait_serving, worker_info

MAX_MODEL_LEN = 256
SPEC = {"num_speculative_tokens": 3, "is_parallel": True}  # minedraft


def _config(pair, spec=SPEC, **overrides) -> EngineConfig:
    return tiny_config(pair, spec, **{"max_num_seqs": 16, "max_model_len": MAX_MODEL_LEN, **overrides})


def _workload(n: int = 32) -> list[tuple[list[int], int]]:
    rng = random.Random(7)
    return [([rng.randrange(320) for _ in range(rng.choice([1, 3, 9]))], rng.choice([1, 5, 12])) for _ in range(n)]


@pytest.fixture(scope="module")
def expected(pair) -> list[list[int]]:
    """Offline autoregressive output of the target for `_workload()`."""
    engine = LLMEngine.local(_config(pair, None))
    requests = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=m)) for p, m in _workload()]
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in requests]


class Services:
    """Verifier, drafter and scheduler as separate processes, each restartable with its own command."""

    def __init__(self, config: EngineConfig, worker_flags: list[str] = (), scheduler_flags: list[str] = ()) -> None:
        engine = engine_flags(config)
        self.port, verifier_port, drafter_port, dist_port = free_port(), free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.workers = {"verifier": f"127.0.0.1:{verifier_port}", "drafter": f"127.0.0.1:{drafter_port}"}
        dist = ["--dist-addr", "127.0.0.1", "--dist-port", str(dist_port), "--host", "127.0.0.1", *worker_flags]
        self.commands = {
            "verifier": ["verifier", *engine, *dist, "--port", str(verifier_port)],
            "drafter": ["drafter", *engine, *dist, "--port", str(drafter_port)],
            "scheduler": ["scheduler", *engine, "--host", "127.0.0.1", "--port", str(self.port),
                          "--verifier", self.workers["verifier"], "--drafter", self.workers["drafter"],
                          "--metrics-port", "0", *scheduler_flags],
        }  # fmt: skip
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> subprocess.Popen:
        self.processes[name] = subprocess.Popen([sys.executable, "-m", "minedraft", *self.commands[name]])
        return self.processes[name]

    def __enter__(self) -> Services:
        for name in self.commands:
            self.start(name)
        wait_serving(self.address, timeout_s=180)
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_active(services: Services, at_least: int, timeout_s: float = 60) -> None:
    """Until both workers hold at least `at_least` requests."""
    deadline = time.monotonic() + timeout_s
    while min(worker_info(a).num_active_sequences for a in services.workers.values()) < at_least:
        assert time.monotonic() < deadline, "the workers never held the requests"
        time.sleep(0.1)


def long_streams(address: str, n: int, max_tokens: int = 200) -> list:
    """Start n long streams in the background; the futures give "ok" or the gRPC status name."""

    def one(i: int) -> str:
        with Client(address, retries=0, timeout=300) as client:
            try:
                client.generate([1 + i, 2, 3], max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
            except grpc.RpcError as exc:
                return exc.code().name
            return "ok"

    pool = ThreadPoolExecutor(n)
    futures = [pool.submit(one, i) for i in range(n)]
    pool.shutdown(wait=False)
    return futures


def generate_concurrently(address: str, work) -> list[list[int]]:
    with Client(address, timeout=120) as client, ThreadPoolExecutor(len(work)) as pool:
        return list(pool.map(lambda w: client.generate(w[0], max_tokens=w[1], temperature=0).token_ids, work))


def assert_all_slots_free(services: Services) -> None:
    for role, address in services.workers.items():
        info = worker_info(address)
        assert (info.num_active_sequences, info.num_free_slots) == (0, info.num_slots), (role, info)


def test_step_deadline_follows_observed_steps() -> None:
    deadline = StepDeadline(floor_s=5.0, factor=10.0, percentile=0.99)
    assert deadline.seconds() == 5.0  # nothing observed yet: the floor
    for _ in range(100):
        deadline.observe(0.02)
    assert deadline.seconds() == 5.0  # 10 x 20 ms is below the floor
    for _ in range(100):
        deadline.observe(2.0)
    assert deadline.seconds() == 20.0  # slow steps raise it
    with pytest.raises(ValueError):
        StepDeadline(floor_s=0)


def test_sigterm_drains_the_scheduler(pair) -> None:
    """SIGTERM: NOT_SERVING, new requests get UNAVAILABLE ("draining"), the 16 running ones finish."""
    with Services(_config(pair)) as services:
        streams = long_streams(services.address, 16, max_tokens=60)
        wait_active(services, 16)
        scheduler = services.processes["scheduler"]
        scheduler.send_signal(signal.SIGTERM)
        wait_health(services.address, "NOT_SERVING", timeout_s=10)
        with Client(services.address, retries=0, timeout=30) as client, pytest.raises(grpc.RpcError) as info:
            client.generate([1, 2], max_tokens=4, temperature=0)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
        assert [f.result(timeout=60) for f in streams] == ["ok"] * 16
        assert scheduler.wait(timeout=30) == 0


def test_drain_timeout_cuts_off_what_is_left(pair) -> None:
    with Services(_config(pair), scheduler_flags=["--request-drain-timeout", "0.5"]) as services:
        streams = long_streams(services.address, 16, max_tokens=240)
        wait_active(services, 16)
        services.processes["scheduler"].send_signal(signal.SIGTERM)
        assert {f.result(timeout=60) for f in streams} == {"UNAVAILABLE"}
        assert services.processes["scheduler"].wait(timeout=30) == 0


def _up(pair, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "minedraft", "up", "--model", pair[0], "--port", str(port), "--metrics-port", "0",
         "--speculative-config", json.dumps({**SPEC, "model": pair[1]}), "--device", "cpu", "--max-num-seqs", "16",
         "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "WARNING", "--no-colocate-drafter", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_serving(f"127.0.0.1:{port}", timeout_s=180)
    # `up` supervises once it has seen every service serve and said so; a death before that fails its start-up
    # (exit 2), which is not what these tests kill for.
    for line in up.stdout:  # a pipe: read until that line (it comes within seconds of the scheduler serving)
        if "is serving on" in line:
            break
    else:
        raise AssertionError(f"up exited before it said it serves: {up.stderr.read()[-2000:]}")
    return up, f"127.0.0.1:{port}"


def _services_of(up: subprocess.Popen) -> dict[str, int]:
    """The service processes of `minedraft up`, by role (from their command lines)."""
    services = {}
    for pid in children(up.pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            services[args[args.index(b"minedraft") + 1].decode()] = pid
        except (OSError, ValueError):  # gone, or not yet exec'd (a zombie has no command line)
            continue
    return services


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its parent may be gone and not yet reaped it)


def test_up_drains_on_sigterm(pair) -> None:
    up, address = _up(pair)
    try:
        services = _services_of(up)
        streams = long_streams(address, 16, max_tokens=60)
        time.sleep(1.0)  # the streams are running
        up.send_signal(signal.SIGTERM)
        assert [f.result(timeout=60) for f in streams] == ["ok"] * 16
        assert up.wait(timeout=90) == 0
        assert not [pid for pid in services.values() if _alive(pid)]
    finally:
        if up.poll() is None:
            up.kill()


def test_services_die_with_a_sigkilled_up(pair) -> None:
    up, _ = _up(pair)
    try:
        services = _services_of(up)
        assert set(services) == {"verifier", "drafter", "scheduler"}
    finally:
        up.kill()  # a failure above must not leave `up` behind
        up.wait()
    deadline = time.monotonic() + 60
    while alive := [name for name, pid in services.items() if _alive(pid)]:
        assert time.monotonic() < deadline, f"still running after minedraft up was SIGKILLed: {alive}"
        time.sleep(0.2)


_PRINT_DEATH_SIGNAL = (
    "import ctypes; from minedraft.service.lifetime import watch_parent_from_env; watch_parent_from_env(); "
    "sig = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0); print(sig.value)"
)  # prctl(PR_GET_PDEATHSIG)


def _death_signal_of_child() -> int:
    options = supervised_child()
    out = subprocess.run([sys.executable, "-c", _PRINT_DEATH_SIGNAL], capture_output=True, text=True, check=True,
                         **options)  # fmt: skip
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_asks_for_the_parent_death_signal_itself() -> None:
    """A child of the main thread asks the kernel for SIGTERM when its parent dies, without a preexec_fn (which
    would fork() a parent that runs gRPC threads); a child of another thread does not (the signal would come
    when that thread ends) and keeps the watchdog alone."""
    assert _death_signal_of_child() == signal.SIGTERM
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(_death_signal_of_child).result() == 0


def test_up_without_restarts_exits_non_zero_when_a_service_dies(pair) -> None:
    """--crash-loop-restarts 0: the first exit of a service stops every service (tests/test_up_supervision.py
    has the restarts)."""
    up, _ = _up(pair, "--crash-loop-restarts", "0")
    try:
        services = _services_of(up)
        os.kill(services["drafter"], signal.SIGKILL)
        assert up.wait(timeout=90) == 1
        assert "the drafter was killed by SIGKILL after 0 restarts" in up.stderr.read()
        assert not [pid for pid in services.values() if _alive(pid)]
    finally:
        if up.poll() is None:
            up.kill()


def _listening(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                raw = bytes.fromhex(address)
                words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]  # little-endian 32-bit words
                text = socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, b"".join(words))
                found.add(text.removeprefix("::ffff:"))  # an IPv4-mapped address is the IPv4 one
    return found


def _gauges(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    names = ("minedraft:num_requests_waiting", "minedraft:num_requests_running", "minedraft:kv_cache_usage_perc")
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] in names}


def test_listeners_bind_the_host_and_gauges_settle_when_idle(pair) -> None:
    metrics_port = free_port()
    with Services(_config(pair), scheduler_flags=["--metrics-port", str(metrics_port)]) as services:
        dist_port = int(services.commands["verifier"][services.commands["verifier"].index("--dist-port") + 1])
        for port in (metrics_port, dist_port, services.port):
            assert _listening(port) == {"127.0.0.1"}, port
        streams = long_streams(services.address, 16, max_tokens=60)
        wait_active(services, 16)
        busy = _gauges(metrics_port)
        assert busy["minedraft:num_requests_running"] > 0 and busy["minedraft:kv_cache_usage_perc"] > 0
        assert [f.result(timeout=60) for f in streams] == ["ok"] * 16
        deadline = time.monotonic() + 10
        while any(_gauges(metrics_port).values()):
            assert time.monotonic() < deadline, f"gauges stuck at the last step's load: {_gauges(metrics_port)}"
            time.sleep(0.2)
