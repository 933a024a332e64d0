"""The serving commands: `up` (the whole stack on this machine), and the services as a pod runs them: `gateway`,
`scheduler`, `verifier`, `drafter`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from minedraft.cli.common import (
    add_api_key_args,
    add_engine_args,
    add_listen_args,
    add_settings_args,
    api_keys,
    check_model_folders,
    check_tls_files,
    checkpoint_given,
    engine_config,
    listen_settings,
    read_flag_file,
    settings,
)
from minedraft.cli.flags import CliModel, add_group, as_flag, model_from_args
from minedraft.config import DistributedConfig, EngineConfig
from minedraft.settings import (
    BACKEND_API_KEY_ENV,
    GatewaySettings,
    PublicApiSettings,
    SchedulerSettings,
    SupervisorSettings,
    WorkerSettings,
)
from minedraft.stack.supervision import Supervisor

# `minedraft up` is the embedded demo: MineDraft with the bundled pair unless told otherwise.
UP_DEFAULTS = {"speculative_config": '{"num_speculative_tokens": 4, "is_parallel": true}'}


class DistSettings(CliModel):
    """Where a worker meets the others for torch.distributed (drafter <-> verifier tensors)."""

    dist_addr: str = Field("127.0.0.1", description="verifier rank 0's address (rendezvous)")
    dist_port: int = Field(29500, ge=1, le=65535, description="rendezvous port on verifier rank 0")
    dist_backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="auto (NCCL on CUDA, gloo on CPU), nccl, gloo"
    )


class PoolMembership(CliModel):
    """Whether a drafter serves one engine group or several (a member of a drafter pool)."""

    pool_groups: int = Field(
        0, ge=0, le=1024, description="0: the drafter of one engine group, in its world; N: a member of a drafter "
        "pool that serves up to N groups (schedulers started with --drafter-pool), handing drafts and results over "
        "gRPC",
    )  # fmt: skip


class WorkerAddresses(CliModel):
    """Where the scheduler reaches its workers."""

    verifier: str = Field("127.0.0.1:50061", description="verifier rank 0's gRPC address")
    drafter: str = Field("127.0.0.1:50062", description="drafter's gRPC address (ignored without speculation; "
                         "empty: none, for a verifier started with --colocate-drafter)")
    drafter_pool: list[str] | None = Field(
        None, description="draft with a member of this drafter pool instead (drafters started with --pool-groups): "
        "HOST:PORT, repeatable (the variable: comma-separated); a host with several addresses (a headless "
        "Service) is one member per address. --drafter is then ignored.", json_schema_extra=as_flag(repeat=True),
    )  # fmt: skip

    @field_validator("drafter_pool", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        """MINEDRAFT_DRAFTER_POOL: a comma-separated list."""
        items = value.split(",") if isinstance(value, str) else value or []
        return [item.strip() for item in items if item.strip()] or None


class EngineGroups(CliModel):
    """How many engine groups `up` starts, and whether they share pool drafters."""

    engine_groups: int = Field(
        1, ge=1, description="engine groups (verifier, drafter, scheduler each); above 1 a gateway serves at --port "
        "in front of them",
    )  # fmt: skip
    drafter_pool: int = Field(
        0, ge=0, description="pool drafters shared by all engine groups instead of a drafter per group (0: one per "
        "group); a gateway serves in front",
    )  # fmt: skip


class GatewayBackends(CliModel):
    """Where the gateway finds the engine groups' schedulers, and the tokenizer it derives text with."""

    backend: list[str] | None = Field(
        None, description="a scheduler's HOST:PORT, or HOST:PORT@METRICS_PORT to route by its queue too "
        "(repeatable; the variable: comma-separated)", json_schema_extra=as_flag(repeat=True),
    )  # fmt: skip
    k8s_service: str | None = Field(None, description="discover the schedulers from this Service's EndpointSlices "
                                    "instead")  # fmt: skip
    namespace: str = Field("default", description="namespace of --k8s-service")
    port_name: str = Field("grpc", description="the scheduler port's name in the EndpointSlices")
    tokenizer: str | None = Field(
        None, description="folder of the target's tokenizer.json (text is derived at the gateway, exact across a "
        "migration); default: the bundled target",
    )  # fmt: skip

    @field_validator("backend", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        """MINEDRAFT_BACKEND: a comma-separated list; each address is checked."""
        from minedraft.gateway.service import parse_backend

        items = value.split(",") if isinstance(value, str) else value or []
        backends = [b.strip() for b in items if b.strip()]
        for backend in backends:
            parse_backend(backend)
        return backends


def dist_config(args: argparse.Namespace) -> DistributedConfig:
    dist = model_from_args(args, DistSettings)
    return DistributedConfig(
        master_addr=dist.dist_addr, master_port=dist.dist_port, backend=dist.dist_backend,
        timeout_s=settings(args, WorkerSettings).dist_timeout,
        store_host=listen_settings(args).host,  # the store listens where the gRPC server does
    )  # fmt: skip


def cmd_verifier(args: argparse.Namespace) -> int:
    from minedraft.worker.verifier import serve_verifier

    return _serve_worker(args, serve_verifier, target=True)


def cmd_drafter(args: argparse.Namespace) -> int:
    from minedraft.worker.drafter import serve_drafter

    groups = model_from_args(args, PoolMembership).pool_groups
    if groups:  # a member of a drafter pool: in no group's world
        from minedraft.pool.service import serve_pool_drafter

        return _serve_worker(args, lambda config, dist, *rest: serve_pool_drafter(config, groups, *rest),
                             target=False)  # fmt: skip
    return _serve_worker(args, serve_drafter, target=False)


def _serve_worker(args: argparse.Namespace, serve: Any, target: bool) -> int:
    """A verifier (it loads the target) or a drafter (the draft), serving until it is stopped."""
    config, listen = engine_config(args), listen_settings(args)
    check_model_folders(config, target=target, draft=not target)
    configure_logging(listen.log_level)
    serve(config, dist_config(args), settings(args, WorkerSettings), listen.host, listen.port)
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    from minedraft.scheduler.server import PublicApi, serve_scheduler

    listen, workers = listen_settings(args), model_from_args(args, WorkerAddresses)
    api = PublicApi(settings(args, SchedulerSettings), host=listen.host, port=listen.port, api_keys=api_keys(args))
    check_tls_files(api.settings)
    config = engine_config(args)
    check_model_folders(config, draft=False)
    configure_logging(listen.log_level)
    if workers.drafter_pool:
        from minedraft.pool import check_poolable

        check_poolable(config)
    asyncio.run(serve_scheduler(config, api, verifier=workers.verifier, drafter=workers.drafter or None,
                                drafter_pool=workers.drafter_pool))  # fmt: skip
    return 0


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def up_stack(args: argparse.Namespace):
    """What `minedraft up` starts (not started yet): one engine group, or N behind a gateway."""
    from minedraft.stack.gateway import GatewayStack
    from minedraft.stack.local import LocalStack

    config = engine_config(args, base=UP_DEFAULTS)
    check_model_folders(config)
    topology, listen = model_from_args(args, EngineGroups), listen_settings(args)
    groups = topology.engine_groups
    scheduler, keys = settings(args, SchedulerSettings), api_keys(args)
    check_tls_files(scheduler)
    options = {"host": listen.host, "port": listen.port, "log_level": listen.log_level, "scheduler": scheduler,
               "worker": settings(args, WorkerSettings, aliases=False), "log_dir": _up_log_dir(args)}  # fmt: skip
    if topology.drafter_pool:
        from minedraft.pool import check_poolable

        check_poolable(config)
    if groups == 1 and not topology.drafter_pool:
        return LocalStack(config, **options, api_keys=keys.keys)
    # The gateway is the public edge: it takes the public flags; the groups behind it serve gRPC to it alone,
    # in plaintext on this machine.
    gateway = settings(args, GatewaySettings)
    if gateway.backend_tls_ca or gateway.backend_tls_server_name:
        raise ValueError("--backend-tls-ca and --backend-tls-server-name do not apply to up: its engine groups "
                         "serve the gateway in plaintext on this machine (--tls-cert puts TLS on the gateway)")
    options["scheduler"] = scheduler.model_copy(update={"http_port": 0, "tls_cert": None, "tls_key": None})
    return GatewayStack(config, groups, **options, gateway=gateway, api_keys=keys.keys,
                        drafter_pool=topology.drafter_pool)  # fmt: skip


def _up_log_dir(args: argparse.Namespace) -> Path | None:
    log_dir = settings(args, SupervisorSettings).log_dir
    if log_dir is None:
        return None
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return Path(log_dir)


def cmd_up(args: argparse.Namespace) -> int:
    stack = up_stack(args)  # validate before starting anything
    # SIGTERM (and SIGINT, even when a non-interactive shell started us with it ignored) stop the stack
    # through the context manager, so no service process is left behind.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    groups = model_from_args(args, EngineGroups).engine_groups
    supervisor = Supervisor(stack, settings(args, SupervisorSettings))
    with stack:
        try:
            behind = f", {groups} engine groups behind a gateway" if groups > 1 else ""
            print(f"MineDraft ({stack.config.mode.value}{behind}) is serving on {stack.address}; Ctrl-C stops it",
                  flush=True)  # fmt: skip
            if stack.http_url:
                print(f"OpenAI-compatible API: {stack.http_url}/v1", flush=True)
            metrics_port = settings(args, SchedulerSettings).metrics_port
            if metrics_port:
                print(f"Prometheus metrics: http://{listen_settings(args).host}:{metrics_port}/metrics"
                      + (" (group i: port + i)" if groups > 1 else ""), flush=True)  # fmt: skip
            # Until a signal, or a service that crash-loops: a service that exits is started again.
            return supervisor.run()
        except KeyboardInterrupt:  # a signal once serving, before the supervisor's loop took it: the same clean stop
            return 0


def _backend_access(args: argparse.Namespace, gateway: GatewaySettings):
    """How the gateway reaches the schedulers: its own key (--backend-api-key-file, else
    $MINEDRAFT_BACKEND_API_KEY) and the certificates it trusts for their TLS."""
    from minedraft.gateway.pool import BackendAccess

    key = os.environ.get(BACKEND_API_KEY_ENV, "").strip() or None
    if args.backend_api_key_file:
        key = read_flag_file("--backend-api-key-file", args.backend_api_key_file).decode().strip()
        if not key:
            raise ValueError(f"--backend-api-key-file {args.backend_api_key_file} is empty")
    ca = read_flag_file("--backend-tls-ca", gateway.backend_tls_ca) if gateway.backend_tls_ca else None
    return BackendAccess(api_key=key, tls_ca=ca, tls_server_name=gateway.backend_tls_server_name)


def cmd_gateway(args: argparse.Namespace) -> int:
    from minedraft.gateway.service import GatewayApi, serve_gateway

    listen, backends = listen_settings(args), model_from_args(args, GatewayBackends)
    if bool(backends.backend) == bool(backends.k8s_service):
        raise ValueError("give the engine groups either as --backend HOST:PORT (repeatable) or as --k8s-service")
    gateway = settings(args, GatewaySettings)
    check_tls_files(gateway)
    api = GatewayApi(gateway, host=listen.host, port=listen.port, api_keys=api_keys(args),
                     access=_backend_access(args, gateway))  # fmt: skip
    tokenizer = backends.tokenizer or str(EngineConfig().target_path)
    if not checkpoint_given(tokenizer):
        raise ValueError(f"--tokenizer {tokenizer}: no such folder (the target checkpoint's, with tokenizer.json, or "
                         "its GGUF file)")
    configure_logging(listen.log_level)
    asyncio.run(
        serve_gateway(
            api, tokenizer_path=tokenizer, backends=backends.backend, k8s_service=backends.k8s_service,
            namespace=backends.namespace, port_name=backends.port_name,
        )
    )  # fmt: skip
    return 0


def add_serve_parsers(sub: Any) -> None:
    """The parsers of up, gateway, verifier, drafter and scheduler."""
    up = sub.add_parser(
        "up",
        help="start verifier, drafter and scheduler as local processes (the embedded default)",
        description="Start the whole stack on this machine with the bundled models, in MineDraft mode unless "
        "--speculative-config says otherwise ('null' = plain autoregressive decoding). A service that exits is "
        "started again (with back-off); only one that crash-loops, or a signal, stops the stack.",
    )
    add_engine_args(up, base=UP_DEFAULTS)
    add_listen_args(up, {"host": "127.0.0.1", "port": 50051})
    add_group(up, EngineGroups, "engine groups")
    add_api_key_args(up)
    add_settings_args(up, SchedulerSettings, "scheduler (of every engine group; metrics port: group i gets port + i)")
    add_settings_args(up, WorkerSettings, "workers (drafter and verifier of every engine group)", aliases=False)
    add_settings_args(up, GatewaySettings, "gateway (with --engine-groups above 1: it serves the public flags "
                      "above, --http-port, keys and TLS)", shared=PublicApiSettings.model_fields)
    add_settings_args(up, SupervisorSettings, "supervision (a service that exits is started again)")
    up.set_defaults(func=cmd_up)
    _add_gateway_parser(sub)
    for name, port, func, help_text in (
        ("verifier", 50061, cmd_verifier, "run the verifier service (all tensor-parallel ranks), as a pod does"),
        ("drafter", 50062, cmd_drafter, "run the drafter service, as a pod does"),
    ):
        worker = sub.add_parser(name, help=help_text)
        add_engine_args(worker)
        add_listen_args(worker, {"port": port})
        add_group(worker, DistSettings, "torch.distributed (drafter <-> verifier tensors)")
        if name == "drafter":
            add_group(worker, PoolMembership, "drafter pool")
        add_settings_args(worker, WorkerSettings, "worker")
        worker.set_defaults(func=func)
    scheduler = sub.add_parser("scheduler", help="run the scheduler (public gRPC and OpenAI HTTP APIs), as a pod does")
    add_engine_args(scheduler)
    add_listen_args(scheduler, {"port": 50051})
    add_group(scheduler, WorkerAddresses, "workers")
    add_api_key_args(scheduler)
    add_settings_args(scheduler, SchedulerSettings, "scheduler")
    scheduler.set_defaults(func=cmd_scheduler)


def _add_gateway_parser(sub: Any) -> None:
    gateway = sub.add_parser(
        "gateway",
        help="run the gateway: the public gRPC and OpenAI HTTP APIs in front of N engine groups, with request "
        "migration",
        description="Routes each request to the serving engine group (scheduler) with the least outstanding work "
        "and, when that group fails mid-request, resubmits prompt + tokens streamed so far to another one; the "
        "client's stream continues. Stateless: run as many replicas as you like.",
    )
    add_listen_args(gateway, {"port": 50050})
    add_group(gateway, GatewayBackends, "engine groups")
    add_api_key_args(gateway)
    gateway.add_argument(
        "--backend-api-key-file", default=None, help="file with the gateway's own API key, sent to the schedulers "
        f"(never a client's key); also from ${BACKEND_API_KEY_ENV}. None: the schedulers take no key",
    )  # fmt: skip
    add_settings_args(gateway, GatewaySettings, "gateway")
    gateway.set_defaults(func=cmd_gateway)
