"""What the drafter and the verifier nodes share: joining the world, sizing the cache, describing
themselves to the scheduler."""

from __future__ import annotations

import logging

from minedraft.api import worker_pb2
from minedraft.config import DistributedConfig, EngineConfig
from minedraft.engine.workers import DraftWorker, VerifyWorker
from minedraft.model.config import load_model_config
from minedraft.scheduler_watch import SchedulerWatch
from minedraft.transport.groups import Topology, WorldGroups, init_world

log = logging.getLogger("minedraft.worker")


def topology_of(config: EngineConfig) -> Topology:
    return Topology(tp_size=config.tensor_parallel_size, has_drafter=config.speculative_config is not None)


def max_model_len_of(config: EngineConfig) -> int:
    return config.max_model_len or load_model_config(config.target_path).max_position_embeddings


def join_world(config: EngineConfig, dist: DistributedConfig, rank: int, device: str) -> WorldGroups:
    """Form the world group with the verifier ranks and the drafter (blocks until all have joined)."""
    return init_world(
        rank=rank,
        topology=topology_of(config),
        master_addr=dist.master_addr,
        master_port=dist.master_port,
        device=device,
        backend=None if dist.backend == "auto" else dist.backend,
        timeout_s=dist.timeout_s,
        store_host=dist.store_host,
    )


def drop_all_requests(worker: DraftWorker | VerifyWorker, reason: str) -> None:
    """Forget every request (KV slots free): their scheduler is gone."""
    if worker.num_active:
        log.warning("dropping the state of %d requests: %s", worker.num_active, reason)
    worker.release(list(worker.sequences))


def begin_plan(watch: SchedulerWatch, worker: DraftWorker | VerifyWorker, plan: worker_pb2.StepPlan) -> None:
    """Before applying a plan: drop all state if it comes from a new scheduler or after a long silence."""
    reason = watch.on_plan(plan.scheduler_id)
    if reason is not None:
        drop_all_requests(worker, reason)


def worker_info(
    role: str, model: str, worker: DraftWorker | VerifyWorker, rank: int, config: EngineConfig
) -> worker_pb2.WorkerInfo:
    runner = worker.runner
    return worker_pb2.WorkerInfo(
        role=role,
        model=model,
        num_slots=runner.kv_cache.num_slots,
        num_free_slots=runner.num_free_slots,
        num_active_sequences=worker.num_active,
        vocab_size=runner.config.vocab_size,
        max_model_len=runner.max_seq_len,
        eos_token_ids=runner.config.eos_token_ids,
        world_rank=rank,
        tensor_parallel_size=config.tensor_parallel_size,
    )
