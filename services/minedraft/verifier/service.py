"""`minedraft verifier`: rank 0 serves the Worker gRPC API; ranks 1..tp-1 run as child processes."""

from __future__ import annotations

import logging
import multiprocessing as mp

from minedraft.config import DistributedConfig, EngineConfig
from minedraft.service.lifetime import die_with_parent, wait_for_termination
from minedraft.serving import NodeServicer, start_worker_server
from minedraft.settings import WorkerSettings
from minedraft.verifier.node import VerifierNode
from minedraft.verifier.pair import PairNode

log = logging.getLogger("minedraft.verifier")


def _follower_main(config_json: str, dist_json: str, rank: int, threads_beside: int) -> None:
    die_with_parent()  # a SIGKILLed rank 0 must not leave its followers behind
    node = VerifierNode(
        EngineConfig.model_validate_json(config_json), DistributedConfig.model_validate_json(dist_json), rank,
        threads_beside,
    )
    try:
        node.follow()
    finally:
        node.close()


def serve_verifier(
    config: EngineConfig, dist: DistributedConfig, settings: WorkerSettings, host: str, port: int
) -> None:
    followers = [
        mp.get_context("spawn").Process(
            target=_follower_main,
            args=(config.model_dump_json(), dist.model_dump_json(), rank, settings.cpu_threads_beside),
            name=f"verifier-rank-{rank}",
            daemon=True,
        )
        for rank in range(1, config.tensor_parallel_size)
    ]
    for process in followers:
        process.start()
    holder: dict = {}

    def load() -> VerifierNode | PairNode:
        colocate = settings.colocate_drafter and config.speculative_config is not None
        holder["node"] = PairNode(config) if colocate else VerifierNode(
            config, dist, rank=0, threads_beside=settings.cpu_threads_beside)
        return holder["node"]

    servicer = NodeServicer()
    server, health, bound = start_worker_server(servicer, host, port)
    servicer.start_loading(load, health)
    log.info("verifier (tp=%d) listening on %s:%d", config.tensor_parallel_size, host, bound)

    def stop() -> None:
        servicer.wait_until_quiet(settings.step_drain_timeout)
        node = holder.get("node")
        if node is not None:
            node.stop_followers()
        server.stop(grace=5).wait()
        for process in followers:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
        if node is not None:
            node.close()

    wait_for_termination(stop)
