"""`minedraft drafter`: the draft model, the draft worker and its end of the step channel, behind the Worker
gRPC API."""

from __future__ import annotations

import logging

from minedraft.api import worker_pb2
from minedraft.config import DistributedConfig, EngineConfig, num_slots
from minedraft.engine.adaptive.threads import StepThreads
from minedraft.engine.runners import build_drafter, max_model_len
from minedraft.engine.step import DraftSide, defers_results
from minedraft.settings import WorkerSettings
from minedraft.transport.channel import StepChannel
from minedraft.transport.groups import WorldGroups, rendezvous_store
from minedraft.wire import lora_adapter_from_proto, plan_from_proto, step_reply
from minedraft.worker.node import check_epoch, join_world, topology_of, worker_info
from minedraft.worker.servicer import NodeServicer, serve_until_stopped, start_worker_server

log = logging.getLogger("minedraft.drafter")


class DrafterNode:
    """The drafter's side of every step (engine/step.py), its end of the channel the world's StepChannel."""

    def __init__(self, config: EngineConfig, dist: DistributedConfig, threads_beside: int = 0) -> None:
        if config.speculative_config is None:
            raise ValueError("the drafter needs a speculative config (plain autoregressive decoding has no drafter)")
        self.config = config
        self.dist = dist
        self.device = _drafter_device(config)
        self.worker = build_drafter(config, num_slots(config), max_model_len(config), self.device)
        self.side = DraftSide(self.worker, threads=StepThreads(self.device, threads_beside),
                              defers=defers_results(config))  # fmt: skip
        self.rank = topology_of(config).drafter_rank
        self.groups: WorldGroups | None = None
        self.epoch: int | None = None

    def join(self, request: worker_pb2.JoinRequest) -> None:
        """Drop every request and meet the verifier ranks in a new world (a store client per join: the
        verifier may have restarted since the last one)."""
        self.leave()
        for name, error in self.worker.set_loras([lora_adapter_from_proto(m) for m in request.lora_adapters]).items():
            log.error("the drafter cannot serve LoRA adapter %r: %s", name, error)
        store = rendezvous_store(self.dist.master_addr, self.dist.master_port, is_master=False,
                                 timeout_s=self.dist.timeout_s)
        self.groups = join_world(self.config, self.dist, self.rank, self.device, store=store, epoch=request.epoch,
                                 has_drafter=True)
        self.side.end = StepChannel(self.groups, support_size=self.config.draft_support_size)
        self.epoch = request.epoch

    def leave(self) -> None:
        self.worker.reset()
        self.side.missed.take()
        self.epoch, self.side.end = None, None
        if self.groups is not None:
            self.groups.close()
            self.groups = None

    def step(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepReply:
        check_epoch(self.epoch, plan)
        return step_reply(plan.step_id, self.side.step(plan_from_proto(plan)), "drafter")

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_info("drafter", str(self.config.draft_path), self.worker, self.rank, self.config, self.epoch)

    def close(self) -> None:
        self.leave()


def _drafter_device(config: EngineConfig) -> str:
    """The GPU after the verifier's when this machine has one (one host running everything); in its own
    pod the drafter sees one GPU, cuda:0. An explicit cuda:N is used as given. A drafter without a model runs on
    the CPU."""
    if config.drafts_without_model:
        return "cpu"
    device = config.resolved_device()
    if device != "cuda":
        return device
    import torch

    return (
        f"cuda:{config.tensor_parallel_size}" if torch.cuda.device_count() > config.tensor_parallel_size else "cuda:0"
    )


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
