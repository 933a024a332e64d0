"""`minedraft drafter`: the draft model behind the Worker gRPC API."""

from __future__ import annotations

import logging

from minedraft.config import DistributedConfig, EngineConfig
from minedraft.drafter.node import DrafterNode
from minedraft.serving import NodeServicer, serve_until_stopped, start_worker_server
from minedraft.settings import WorkerSettings

log = logging.getLogger("minedraft.drafter")


def serve_drafter(
    config: EngineConfig, dist: DistributedConfig, settings: WorkerSettings, host: str, port: int
) -> None:
    if config.speculative_config is None:
        raise ValueError("the drafter needs --speculative-config (plain autoregressive decoding has no drafter)")
    servicer = NodeServicer()
    server, health, bound = start_worker_server(servicer, host, port)
    servicer.start_loading(lambda: DrafterNode(config, dist, settings.cpu_threads_beside), health)
    log.info(
        "drafter listening on %s:%d, joining the verifier at %s:%d", host, bound, dist.master_addr, dist.master_port
    )

    serve_until_stopped(servicer, server, settings.step_drain_timeout)
