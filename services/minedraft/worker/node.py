"""What the drafter and the verifier nodes share: joining the world, sizing the cache, describing
themselves to the scheduler.

A node loads its model once, at start. The world it computes in is formed later, by the scheduler's
`Join`, and formed again (a new epoch) whenever a worker died, came back, or a new scheduler took over:
each join drops every request's state, and the scheduler re-admits what it still runs.
"""

from __future__ import annotations

from typing import Protocol

from minedraft.api import worker_pb2
from minedraft.config import DistributedConfig, EngineConfig
from minedraft.engine.workers import DraftWorker, VerifyWorker
from minedraft.transport.groups import Topology, WorldGroups, init_world


class NotInWorld(RuntimeError):
    """A step for a world this node is not in (no join yet, or a plan of an older epoch)."""


def check_epoch(node_epoch: int | None, plan: worker_pb2.StepPlan) -> None:
    if node_epoch is None or plan.epoch != node_epoch:
        raise NotInWorld(f"step {plan.step_id} is for epoch {plan.epoch}; this worker is in {node_epoch}")


class WorkerNode(Protocol):
    """What the Worker gRPC service drives: the drafter node and verifier rank 0 alike."""

    def join(self, request: worker_pb2.JoinRequest) -> None:
        """Drop every request, leave the current world and form the requested one (blocks until formed)."""

    def step(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepReply:
        """Apply the plan's releases and admissions, run its part of the step, then the step-end exchange."""

    def info(self) -> worker_pb2.WorkerInfo: ...

    def close(self) -> None: ...


def topology_of(config: EngineConfig) -> Topology:
    return Topology(tp_size=config.tensor_parallel_size, has_drafter=config.speculative_config is not None)


def join_world(
    config: EngineConfig, dist: DistributedConfig, rank: int, device: str, *, store, epoch: int | str,
    has_drafter: bool,
) -> WorldGroups:
    """Form one epoch's world with the verifier ranks (and the drafter): blocks until all have joined."""
    return init_world(
        rank=rank,
        topology=Topology(tp_size=config.tensor_parallel_size, has_drafter=has_drafter),
        master_addr=dist.master_addr,
        master_port=dist.master_port,
        device=device,
        backend=None if dist.backend == "auto" else dist.backend,
        timeout_s=dist.timeout_s,
        store=store,
        epoch=epoch,
    )  # fmt: skip


def worker_info(
    role: str, model: str, worker: DraftWorker | VerifyWorker, rank: int, config: EngineConfig, epoch: int | None
) -> worker_pb2.WorkerInfo:
    runner = worker.runner
    if runner is None:  # a drafter without a model (method ngram, suffix): no KV pool (num_blocks 0), no vocabulary
        return worker_pb2.WorkerInfo(
            role=role, model=model, block_size=config.block_size, num_active_sequences=worker.num_active,
            max_model_len=worker.max_seq_len, world_rank=rank, tensor_parallel_size=config.tensor_parallel_size,
            engine_config_json=config.model_dump_json(), epoch=epoch or 0,
        )  # fmt: skip
    return worker_pb2.WorkerInfo(
        role=role,
        model=model,
        num_blocks=runner.kv_cache.num_blocks,
        num_free_blocks=runner.num_free_blocks,
        block_size=runner.kv_cache.block_size,
        num_active_sequences=worker.num_active,
        vocab_size=runner.config.vocab_size,
        max_model_len=runner.max_seq_len,
        eos_token_ids=runner.config.eos_token_ids,
        world_rank=rank,
        tensor_parallel_size=config.tensor_parallel_size,
        engine_config_json=config.model_dump_json(),
        epoch=epoch or 0,
    )
