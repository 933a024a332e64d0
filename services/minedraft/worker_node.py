"""What the drafter and the verifier nodes share: joining the world, sizing the cache, describing
themselves to the scheduler."""

from __future__ import annotations

from typing import Protocol

from minedraft.api import worker_pb2
from minedraft.config import DistributedConfig, EngineConfig
from minedraft.engine.workers import DraftWorker, VerifyWorker
from minedraft.model.config import load_model_config
from minedraft.transport.groups import Topology, WorldGroups, init_world


class WorkerNode(Protocol):
    """What the Worker gRPC service drives: the drafter node and verifier rank 0 alike."""

    def step(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepReply:
        """Apply the plan's releases and admissions, run its part of the step, then the step-end exchange."""

    def info(self) -> worker_pb2.WorkerInfo: ...

    def close(self) -> None: ...


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
    )


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
        engine_config_json=config.model_dump_json(),
    )
