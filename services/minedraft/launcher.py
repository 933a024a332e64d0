"""Run the whole stack as local processes: verifier (all TP ranks), drafter and scheduler.

This is `minedraft up` and what the end-to-end tests start: exactly the commands a pod runs, with
service addresses on 127.0.0.1 and free ports.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.config import EngineConfig, Mode
from minedraft.supervision import PARENT_ENV, die_with_parent

# How long the scheduler may take to drain on SIGTERM (its --drain-timeout default) and to exit after.
DRAIN_TIMEOUT_S = 30.0
_EXIT_MARGIN_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(config: EngineConfig) -> list[str]:
    """The engine flags that reproduce `config` on a service's command line."""
    flags = [
        "--tensor-parallel-size", str(config.tensor_parallel_size),
        "--max-num-seqs", str(config.max_num_seqs),
        "--dtype", config.dtype,
        "--device", config.device,
        "--seed", str(config.seed),
    ]  # fmt: skip
    if config.batch_invariant:
        flags.append("--batch-invariant")
    if config.model:
        flags += ["--model", config.model]
    if config.max_model_len:
        flags += ["--max-model-len", str(config.max_model_len)]
    if config.speculative_config is not None:
        flags += ["--speculative-config", config.speculative_config.model_dump_json(exclude_none=True)]
    return flags


def threads_per_worker(config: EngineConfig, cores: int) -> int:
    """Intra-op threads of each model process when all of them share one machine's cores.

    The verifier ranks always compute at the same time, and so does the drafter in the overlapped modes
    (pearl, minedraft): they split the cores, since thread pools that oversubscribe them spin against
    each other. In ar and sd the drafter and the verifier take turns, so each may use every core.
    """
    overlapped = config.mode in (Mode.PEARL, Mode.MINEDRAFT)
    return max(1, cores // (config.tensor_parallel_size + overlapped))


class LocalStack:
    """Start the services, wait until the scheduler reports SERVING, stop them all on exit.

    The services die with this process even when it is SIGKILLed (see `supervision`); on Linux that is
    tied to the thread that starts them, so start the stack from a thread that outlives it."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_waiting: int = 256,
        log_level: str = "INFO",
        log_dir: Path | None = None,
        startup_timeout_s: float = 300.0,
        metrics_port: int = 0,
        workers_only: bool = False,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
    ) -> None:
        self.config = config
        self.drain_timeout_s = drain_timeout_s
        self.port = port or free_port()
        self.metrics_port = metrics_port  # the scheduler's Prometheus port; 0 = not served
        self.address = f"{host}:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self._log_dir = log_dir
        self._processes: list[tuple[str, subprocess.Popen]] = []
        verifier_port, drafter_port, dist_port = free_port(), free_port(), free_port()
        self.verifier_address = f"127.0.0.1:{verifier_port}"
        self.drafter_address = f"127.0.0.1:{drafter_port}" if config.speculative_config is not None else None
        engine = engine_flags(config)
        dist = ["--dist-addr", "127.0.0.1", "--dist-port", str(dist_port)]
        common = ["--log-level", log_level]
        self._commands = [
            ("verifier", ["verifier", *engine, *dist, *common, "--host", "127.0.0.1", "--port", str(verifier_port)]),
            ("scheduler", [
                "scheduler", *engine, *common, "--host", host, "--port", str(self.port),
                "--verifier", f"127.0.0.1:{verifier_port}", "--drafter", f"127.0.0.1:{drafter_port}",
                "--max-waiting-requests", str(max_waiting), "--metrics-port", str(metrics_port),
                "--drain-timeout", str(drain_timeout_s),
            ]),
        ]  # fmt: skip
        if config.speculative_config is not None:
            drafter = ["drafter", *engine, *dist, *common, "--host", "127.0.0.1", "--port", str(drafter_port)]
            self._commands.insert(1, ("drafter", drafter))
        if workers_only:  # the caller drives the workers itself (the offline API with tensor parallelism)
            self._commands = [c for c in self._commands if c[0] != "scheduler"]
        self._ready_addresses = (
            [a for a in (self.verifier_address, self.drafter_address) if a] if workers_only else [self.address]
        )

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
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(self.config, os.cpu_count() or 1)))
        env[PARENT_ENV] = str(os.getpid())
        for name, args in self._commands:
            out = open(self._log_dir / f"{name}.log", "w") if self._log_dir else None  # noqa: SIM115
            process = subprocess.Popen(
                [sys.executable, "-m", "minedraft", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                preexec_fn=die_with_parent,
                start_new_session=True,  # a terminal's Ctrl-C reaches only us: we stop the services in order
            )
            self._processes.append((name, process))
        self._wait_serving()

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        for address in self._ready_addresses:
            with grpc.insecure_channel(address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                while not self._serving(health):
                    for name, process in self._processes:
                        if process.poll() is not None:
                            raise RuntimeError(f"the {name} exited with code {process.returncode} during start-up")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the stack did not become SERVING within {self.startup_timeout_s:.0f}s")
                    time.sleep(0.25)

    @staticmethod
    def _serving(health: health_pb2_grpc.HealthStub) -> bool:
        try:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1
        except grpc.RpcError:
            return False

    def process(self, name: str) -> subprocess.Popen:
        """The running process of one service: verifier, drafter or scheduler."""
        return dict(self._processes)[name]

    def wait(self) -> None:
        """Block until a service exits or Ctrl-C."""
        try:
            while all(p.poll() is None for _, p in self._processes):
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass

    def exited(self) -> list[tuple[str, int]]:
        """The services that have exited, with their exit codes (negative: killed by that signal)."""
        return [(name, p.returncode) for name, p in self._processes if p.poll() is not None]

    def stop(self) -> None:
        """Drain first: SIGTERM the scheduler and give it the drain timeout to finish its requests; then
        SIGTERM the workers. SIGKILL what does not exit in time."""
        scheduler = [p for name, p in self._processes if name == "scheduler"]
        workers = [p for name, p in self._processes if name != "scheduler"]
        _terminate(scheduler, self.drain_timeout_s + _EXIT_MARGIN_S)
        _terminate(workers, 20.0)
        self._processes.clear()


def _terminate(processes: list[subprocess.Popen], timeout_s: float) -> None:
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
