"""N engine groups and a gateway in front, as local processes (`minedraft up --engine-groups N`, tests)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from minedraft.config import EngineConfig
from minedraft.frontends.auth import API_KEYS_ENV
from minedraft.settings import (
    BACKEND_API_KEY_ENV,
    GatewaySettings,
    SchedulerSettings,
    WorkerSettings,
    served_model_name,
    settings_flags,
)
from minedraft.stack.fork_server import Process, launch_service
from minedraft.stack.local import (
    LocalStack,
    child_env,
    engine_flags,
    free_port,
    on_cpu,
    scheduler_settings,
    threads_per_worker,
)


class GatewayStack:
    """Start `groups` engine groups (each a `LocalStack`) and one `minedraft gateway` before them.

    `address` is the gateway's; `groups[i].address` a group's scheduler. `kill_group(i)` SIGKILLs every
    process of one group, as a lost node would.
    """

    def __init__(
        self,
        config: EngineConfig,
        groups: int,
        *,
        scheduler: SchedulerSettings | None = None,
        worker: WorkerSettings | None = None,
        gateway: GatewaySettings | None = None,
        api_keys: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "INFO",
        log_dir: Path | None = None,
        startup_timeout_s: float = 300.0,
        metrics_ports: list[int] | None = None,
        group_configs: Sequence[EngineConfig] | None = None,
        drafter_pool: int = 0,
        pool_groups: int | None = None,
    ) -> None:
        """Group i runs group_configs[i] if given (the same target, e.g. with another draft), else `config`. Every
        group runs `scheduler` and `worker`; group i's scheduler serves Prometheus metrics on metrics_ports[i], else
        on scheduler.metrics_port + i (0 = off). With `api_keys` (the clients' keys, checked by the gateway) the
        groups take one key only, made here for the gateway alone. With TLS on the gateway, the start-up health
        checks trust its tls_cert (which must name `host`). `drafter_pool`: that many pool drafters instead of a
        drafter per group (0), each able to serve `pool_groups` groups (default: every group)."""
        _check_groups(config, groups, group_configs, drafter_pool)
        self.config = config
        scheduler = scheduler or scheduler_settings()
        self._api_keys = list(api_keys)
        self._backend_key = secrets.token_urlsafe(32) if api_keys else None
        self.pool = DrafterPoolProcesses(config, drafter_pool, pool_groups or groups, worker or WorkerSettings(),
                                         log_level, log_dir, startup_timeout_s)  # fmt: skip
        configs = group_configs if group_configs is not None else [config] * groups
        ports = metrics_ports or _metrics_ports(scheduler, groups)
        keys = [self._backend_key] if self._backend_key else []
        self.groups = [
            LocalStack(
                configs[i],
                scheduler=scheduler.model_copy(update={"metrics_port": ports[i]}),
                worker=worker,
                log_level=log_level,
                log_dir=_group_dir(log_dir, i),
                startup_timeout_s=startup_timeout_s,
                api_keys=keys,
                drafter_pool=self.pool.addresses,
            )  # fmt: skip
            for i in range(groups)
        ]
        self.settings = _named_gateway(gateway or GatewaySettings(), config, scheduler)
        self.port = port or free_port()
        self.address = f"{host}:{self.port}"
        scheme = "https" if self.settings.tls_cert else "http"
        self.http_url = f"{scheme}://{host}:{self.settings.http_port}" if self.settings.http_port else None
        self._log_dir, self._log_level, self._startup_timeout_s = log_dir, log_level, startup_timeout_s
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        self.gateway: Process | None = None

    def __enter__(self) -> GatewayStack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def gateway_command(
        self, port: int | None = None, settings: GatewaySettings | None = None, groups: Sequence[int] | None = None
    ) -> list[str]:
        """The gateway's command line; another `port` gives a second replica in front of the same groups (or of
        the `groups` named by index)."""
        chosen = self.groups if groups is None else [self.groups[i] for i in groups]
        backends = [arg for group in chosen for arg in ("--backend", _backend_spec(group))]
        host, own_port = self.address.rsplit(":", 1)
        port = str(port or own_port)
        return [
            sys.executable, "-m", "minedraft", "gateway", "--tokenizer", str(self.config.target_path), *backends,
            "--host", host, "--port", port, "--log-level", self._log_level,
            *settings_flags(settings or self.settings),
        ]  # fmt: skip

    def start(self) -> None:
        try:
            self.pool.start()  # first: a group binds to a pool drafter that serves when the group starts
            for group in self.groups:  # the groups and the gateway start side by side
                group.launch()
            self._launch_gateway()
            for group in self.groups:
                group.wait_serving()
            self._wait_gateway()
        except BaseException:
            self.stop()
            raise

    def start_gateway(self) -> None:
        """Start the gateway (again, after it died) and wait until it reports SERVING."""
        self._launch_gateway()
        self._wait_gateway()

    def _wait_gateway(self) -> None:
        _wait_serving(self.address, self.gateway, self._startup_timeout_s, self.settings.tls_cert)

    def _launch_gateway(self) -> Process:
        log = self._log_dir / "gateway.log" if self._log_dir else None
        env = self.gateway_env(child_env(dict(os.environ)))
        self.gateway = launch_service(self.gateway_command(), env, log, forkable=on_cpu(self.config))
        return self.gateway

    def gateway_env(self, env: dict[str, str]) -> dict[str, str]:
        """Keys through the environment (a command line is visible to every local user): the clients' keys,
        and the gateway's own for the groups."""
        env = {k: v for k, v in env.items() if k not in (API_KEYS_ENV, BACKEND_API_KEY_ENV)}
        if self._api_keys:
            env[API_KEYS_ENV] = ",".join(self._api_keys)
        if self._backend_key:
            env[BACKEND_API_KEY_ENV] = self._backend_key
        return env

    def kill_group(self, index: int) -> None:
        for name in ("scheduler", "drafter", "verifier"):
            try:
                process = self.groups[index].process(name)
            except KeyError:
                continue
            process.kill()
            process.wait()

    def processes(self) -> list[tuple[str, Process]]:
        """Every service's latest process, named "group <i> <role>" or "gateway" (what `Supervisor` watches)."""
        named = [(f"group {i} {name}", p) for i, g in enumerate(self.groups) for name, p in g.processes()]
        named += self.pool.processes()
        return named + ([("gateway", self.gateway)] if self.gateway is not None else [])

    def restart(self, name: str) -> Process:
        """Start a service ("gateway", "group <i> <role>") again with its unchanged command, after it died."""
        if name == "gateway":
            return self._launch_gateway()
        if name.startswith("pool "):
            return self.pool.restart(int(name.split(" ")[1]))
        _, index, role = name.split(" ")
        return self.groups[int(index)].restart(role)

    def log_path(self, name: str) -> Path | None:
        if name == "gateway":
            return self._log_dir / "gateway.log" if self._log_dir else None
        if name.startswith("pool "):
            return self.pool.log_path(int(name.split(" ")[1]))
        _, index, role = name.split(" ")
        return self.groups[int(index)].log_path(role)

    def stop(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.terminate()
            try:
                self.gateway.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
                self.gateway.wait()
        for group in self.groups:
            group.stop()
        self.pool.stop()


class DrafterPoolProcesses:
    """The pool drafters of a `GatewayStack` (`minedraft up --drafter-pool N`): `minedraft drafter --pool-groups
    G` processes; `up` lets each serve all G groups, so that one member left standing takes every group."""

    def __init__(self, config: EngineConfig, size: int, groups: int, worker: WorkerSettings, log_level: str,
                 log_dir: Path | None, startup_timeout_s: float) -> None:  # fmt: skip
        self.config = config
        self.ports = [free_port() for _ in range(size)]
        self.addresses = [f"127.0.0.1:{port}" for port in self.ports]
        settings = worker.model_copy(update={"colocate_drafter": False})
        self._args = [*engine_flags(config), "--log-level", log_level, *settings_flags(settings), "--pool-groups",
                      str(groups), "--host", "127.0.0.1"]  # fmt: skip
        self._log_dir = log_dir
        self._startup_timeout_s = startup_timeout_s
        self.members: list[Process] = []

    def command(self, index: int) -> list[str]:
        return [sys.executable, "-m", "minedraft", "drafter", *self._args, "--port", str(self.ports[index])]

    def start(self) -> None:
        """Start every member and wait until each serves (the groups then start speculating at once)."""
        self.members = [self._launch(i) for i in range(len(self.ports))]
        for address, process in zip(self.addresses, self.members):
            _wait_serving(address, process, self._startup_timeout_s, None, what="pool drafter")

    def _launch(self, index: int) -> Process:
        env = child_env(dict(os.environ))
        env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(self.config, os.cpu_count() or 1)))
        return launch_service(self.command(index), env, self.log_path(index), forkable=on_cpu(self.config))

    def restart(self, index: int) -> Process:
        if self.members[index].poll() is None:
            raise RuntimeError(f"pool drafter {index} is still running (pid {self.members[index].pid})")
        self.members[index] = self._launch(index)
        return self.members[index]

    def kill(self, index: int) -> None:
        """SIGKILL one member, as a lost pod would be."""
        self.members[index].kill()
        self.members[index].wait()

    def processes(self) -> list[tuple[str, Process]]:
        return [(f"pool {i} drafter", p) for i, p in enumerate(self.members)]

    def log_path(self, index: int) -> Path | None:
        return self._log_dir / f"pool-{index}.log" if self._log_dir else None

    def stop(self) -> None:
        for process in self.members:
            if process.poll() is None:
                process.terminate()
        for process in self.members:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _check_groups(config: EngineConfig, groups: int, group_configs: Sequence[EngineConfig] | None,
                  drafter_pool: int) -> None:  # fmt: skip
    if groups < 1:
        raise ValueError(f"engine groups must be >= 1, got {groups}")
    if group_configs is not None and len(group_configs) != groups:
        raise ValueError(f"group_configs names {len(group_configs)} configs for {groups} groups")
    if drafter_pool and config.speculative_config is None:
        raise ValueError("a drafter pool drafts for speculative decoding: give --speculative-config")


def _metrics_ports(scheduler: SchedulerSettings, groups: int) -> list[int]:
    """Group i's Prometheus port when none is given: scheduler.metrics_port + i (0 = off)."""
    base = scheduler.metrics_port
    return [base + i if base else 0 for i in range(groups)]


def _named_gateway(settings: GatewaySettings, config: EngineConfig, scheduler: SchedulerSettings) -> GatewaySettings:
    """The gateway's settings, serving the model under the name the groups' schedulers serve it (unless named)."""
    if settings.served_model_name is not None:
        return settings
    return settings.model_copy(update={"served_model_name": served_model_name(config, scheduler)})


def _backend_spec(group: LocalStack) -> str:
    return f"{group.address}@{group.metrics_port}" if group.metrics_port else group.address


def _group_dir(log_dir: Path | None, index: int) -> Path | None:
    if log_dir is None:
        return None
    path = log_dir / f"group-{index}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _wait_serving(address: str, process: Process, timeout_s: float, tls_cert: str | None,
                  what: str = "gateway") -> None:  # fmt: skip
    import grpc

    from minedraft.service.health import probe

    deadline = time.monotonic() + timeout_s
    credentials = grpc.ssl_channel_credentials(Path(tls_cert).read_bytes()) if tls_cert else None
    while not probe(address, credentials):
        if process.poll() is not None:
            raise RuntimeError(f"the {what} exited with code {process.returncode} during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {what} did not become SERVING within {timeout_s:.0f}s")
        time.sleep(0.1)
