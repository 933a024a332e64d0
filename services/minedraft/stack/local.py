"""Run the whole stack as local processes: verifier (all TP ranks), drafter and scheduler.

This is `minedraft up` and what the end-to-end tests start: exactly the commands a pod runs, with
service addresses on 127.0.0.1 and free ports.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from minedraft.config import EngineConfig, Mode
from minedraft.frontends.auth import API_KEYS_ENV
from minedraft.service.health import probe
from minedraft.settings import SETTINGS_MODELS, SchedulerSettings, StartupError, WorkerSettings, settings_flags
from minedraft.stack.fork_server import Process, launch_service

# How long the scheduler may take to exit after its request drain.
_EXIT_MARGIN_S = 15.0


_PORTS_GIVEN: set[int] = set()


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS starts its range higher still


def free_port(span: int = 1) -> int:
    """A port nobody listens on, for a service started a moment later; with `span`, the first of that many
    consecutive free ports (services that serve on port + i).

    Chosen below the kernel's ephemeral range: outgoing connections (gloo pairs, gRPC channels)
    take their local port from that range and could otherwise take this one before the service
    binds it. A port is handed out once per process.
    """
    floor = _ephemeral_floor()
    candidates = range(max(1024, floor - 16384), floor - span + 1)
    for _ in range(200):
        first = random.choice(candidates)
        ports = range(first, first + span)
        if not _PORTS_GIVEN.intersection(ports) and all(_can_bind(port) for port in ports):
            _PORTS_GIVEN.update(ports)
            return first
    raise OSError(f"no free port found in {candidates.start}-{candidates.stop - 1}")


def _can_bind(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def engine_flags(config: EngineConfig) -> list[str]:
    """The one flag that gives a service the whole engine config: every process of a group runs the same."""
    return ["--engine-config", config.model_dump_json()]


def threads_per_worker(config: EngineConfig, cores: int) -> int:
    """Intra-op threads of each model process when all of them share one machine's cores: the verifier ranks
    always compute at the same time, so they split the cores; a drafter may use as many as one rank."""
    return max(1, cores // config.tensor_parallel_size)


def threads_beside(config: EngineConfig, cores: int) -> int:
    """Threads of a worker's step part that runs beside the other worker's (MineDraft's and PEARL's overlapped
    steps): the drafter takes a share of the cores beside the verifier ranks' (WorkerSettings.cpu_threads_beside)."""
    overlaps = config.mode in (Mode.PEARL, Mode.MINEDRAFT)
    return max(1, cores // (config.tensor_parallel_size + 1)) if overlaps else 0


def scheduler_settings(**fields) -> SchedulerSettings:
    """A launched scheduler's settings: the model's defaults, but no metrics port unless asked (tests start
    many stacks at once)."""
    return SchedulerSettings(**{"metrics_port": 0, **fields})


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` without the MINEDRAFT_ variables of engine and service settings: a child gets those whole, as
    JSON flags, and a variable inherited from the launcher's shell would override them."""
    models = (EngineConfig, *SETTINGS_MODELS)
    names = {n for m in models for n in m.model_fields} | {m.json_name for m in SETTINGS_MODELS}
    names |= {"engine_config"} | {old for m in SETTINGS_MODELS for old in m.deprecated_names}
    return {k: v for k, v in env.items() if k not in {"MINEDRAFT_" + n.upper() for n in names}}


def on_cpu(config: EngineConfig) -> bool:
    """Whether the stack's model processes run on CPU (their services may then be forked: stack/fork_server.py)."""
    return config.resolved_device() == "cpu"


def colocates_by_default(config: EngineConfig) -> bool:
    """Whether a stack on this machine runs the drafter inside the verifier's process when not told: at tensor
    parallel size 1 on CPU, where a drafter process would only share the verifier's cores and add a hand-over
    between two processes to every step (docs/services.md), and on any device for drafting without a model,
    whose lookups cost less than that hand-over. On GPUs a draft model keeps a process of its own."""
    return (config.speculative_config is not None and config.tensor_parallel_size == 1
            and (config.resolved_device() == "cpu" or config.drafts_without_model))  # fmt: skip


class LocalStack:
    """Start the services, wait until the scheduler reports SERVING, stop them all on exit.

    The services die with this process even when it is SIGKILLed (see `service.lifetime.supervised_child`),
    whichever thread starts or restarts them."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        scheduler: SchedulerSettings | None = None,
        worker: WorkerSettings | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_keys: Sequence[str] = (),
        log_level: str = "INFO",
        log_dir: Path | None = None,
        startup_timeout_s: float = 300.0,
        workers_only: bool = False,
        drafter_pool: list[str] | None = None,
    ) -> None:
        """`scheduler`: default `scheduler_settings()`. With TLS, the start-up health checks trust its
        tls_cert (which must name `host`). `drafter_pool`: the group drafts with a member of this pool (started
        apart, see stack/gateway.py) and runs no drafter of its own."""
        self.config = config
        self.scheduler = scheduler or scheduler_settings()
        self.worker = worker or WorkerSettings()
        self.drafter_pool = drafter_pool or []
        if self.drafter_pool:
            self.worker = self.worker.model_copy(update={"colocate_drafter": False})
        if self.worker.colocate_drafter is None:
            self.worker = self.worker.model_copy(update={"colocate_drafter": colocates_by_default(config)})
        if not self.worker.cpu_threads_beside:
            beside = threads_beside(config, os.cpu_count() or 1)
            self.worker = self.worker.model_copy(update={"cpu_threads_beside": beside})
        self.port = port or free_port()
        self.metrics_port = self.scheduler.metrics_port  # 0 = not served
        self.address = f"{host}:{self.port}"
        self.http_port = self.scheduler.http_port
        self.http_url = f"{'https' if self.scheduler.tls_cert else 'http'}://{host}:{self.http_port}" if (
            self.http_port) else None  # fmt: skip
        self._api_keys = list(api_keys)
        self.startup_timeout_s = startup_timeout_s
        self._log_dir = log_dir
        self._processes: list[tuple[str, Process]] = []
        self._commands = self._build_commands(host, log_level)
        if workers_only:  # the caller drives the workers itself (the offline API with tensor parallelism)
            self._commands = [c for c in self._commands if c[0] != "scheduler"]
        self._ready_addresses = (
            [a for a in (self.verifier_address, self.drafter_address) if a] if workers_only else [self.address]
        )

    def _build_commands(self, host: str, log_level: str) -> list[tuple[str, list[str]]]:
        """Each service's `minedraft ...` arguments: the engine config and its settings as one JSON each."""
        verifier_port, drafter_port, dist_port = free_port(), free_port(), free_port()
        self.verifier_address = f"127.0.0.1:{verifier_port}"
        speculative = self.config.speculative_config is not None
        # else the verifier drafts itself, or the group drafts with a pool's member
        drafter_service = speculative and not self.worker.colocate_drafter and not self.drafter_pool
        self.drafter_address = f"127.0.0.1:{drafter_port}" if drafter_service else None
        pool = [arg for address in self.drafter_pool for arg in ("--drafter-pool", address)]
        engine = [*engine_flags(self.config), "--log-level", log_level]
        worker = [*engine, "--dist-addr", "127.0.0.1", "--dist-port", str(dist_port), *settings_flags(self.worker),
                  "--host", "127.0.0.1"]  # fmt: skip
        commands = [
            ("verifier", ["verifier", *worker, "--port", str(verifier_port)]),
            ("drafter", ["drafter", *worker, "--port", str(drafter_port)]),
            ("scheduler", ["scheduler", *engine, "--host", host, "--port", str(self.port), "--verifier",
                           self.verifier_address, "--drafter", self.drafter_address or "", *pool,
                           *settings_flags(self.scheduler)]),
        ]  # fmt: skip
        return [c for c in commands if drafter_service or c[0] != "drafter"]

    @property
    def commands(self) -> dict[str, list[str]]:
        """Each service's arguments to `minedraft` (what it is started, and restarted, with)."""
        return dict(self._commands)

    @property
    def drain_timeout_s(self) -> float:
        """How long the scheduler drains its requests on SIGTERM."""
        return self.scheduler.request_drain_timeout

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start every service and wait until it is SERVING; on any failure stop what was started."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self.launch()
        self.wait_serving()

    def launch(self) -> None:
        """Start every service without waiting for it (`wait_serving` waits): a gateway stack starts its groups
        side by side."""
        for name, args in self._commands:
            self._processes.append((name, self._launch(name, args)))

    def _launch(self, name: str, args: list[str]) -> Process:
        env = child_env(dict(os.environ))
        env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(self.config, os.cpu_count() or 1)))
        if name == "scheduler":
            env = self._scheduler_env(env)
        log = self._log_dir / f"{name}.log" if self._log_dir else None
        return launch_service([sys.executable, "-m", "minedraft", *args], env, log, forkable=on_cpu(self.config))

    def restart(self, name: str) -> Process:
        """Start a service again with its unchanged command (as Kubernetes restarts a pod), after it died."""
        old = self.process(name)
        if old.poll() is None:
            raise RuntimeError(f"the {name} is still running (pid {old.pid})")
        process = self._launch(name, dict(self._commands)[name])
        self._processes = [(n, process if n == name else p) for n, p in self._processes]
        return process

    def _scheduler_env(self, env: dict[str, str]) -> dict[str, str]:
        """API keys through the environment: a command line is visible to every local user."""
        return {**env, API_KEYS_ENV: ",".join(self._api_keys)} if self._api_keys else env

    def wait_serving(self) -> None:
        """Wait until the scheduler (with `workers_only`, each worker) reports SERVING; a service that exits
        first is a StartupError naming it, a start that takes longer than the start-up timeout a TimeoutError."""
        deadline = time.monotonic() + self.startup_timeout_s
        for address in self._ready_addresses:
            credentials = self._credentials(address)
            while not probe(address, credentials):
                for name, process in self._processes:
                    if process.poll() is not None:
                        raise StartupError(self._exit_message(name, process.returncode))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the stack did not become SERVING within {self.startup_timeout_s:.0f}s")
                time.sleep(0.1)

    def _exit_message(self, name: str, code: int) -> str:
        """Why a service died at start-up: its log's last lines, or (logging to our stderr) a pointer there."""
        message = f"the {name} exited with code {code} during start-up"
        if not self._log_dir:
            return f"{message} (its error is above)"
        log = self._log_dir / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-12:] if log.exists() else []
        return f"{message}; the end of {log}:\n" + "\n".join(tail)

    def _credentials(self, address: str) -> grpc.ChannelCredentials | None:
        cert = self.scheduler.tls_cert
        return grpc.ssl_channel_credentials(Path(cert).read_bytes()) if cert and address == self.address else None

    def process(self, name: str) -> Process:
        """The running process of one service: verifier, drafter or scheduler."""
        return dict(self._processes)[name]

    def processes(self) -> list[tuple[str, Process]]:
        """Each service's latest process (what `supervision.Supervisor` watches and restarts)."""
        return list(self._processes)

    def log_path(self, name: str) -> Path | None:
        """Where a service logs (None: to this process's stderr)."""
        return self._log_dir / f"{name}.log" if self._log_dir else None

    def stop(self) -> None:
        """Drain first: SIGTERM the scheduler and give it the drain timeout to finish its requests; then
        SIGTERM the workers. SIGKILL what does not exit in time."""
        scheduler = [p for name, p in self._processes if name == "scheduler"]
        workers = [p for name, p in self._processes if name != "scheduler"]
        _terminate(scheduler, self.drain_timeout_s + _EXIT_MARGIN_S)
        _terminate(workers, 20.0)
        self._processes.clear()


def _terminate(processes: list[Process], timeout_s: float) -> None:
    """SIGTERM all at once, wait up to `timeout_s` for them together, then SIGKILL the rest."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
