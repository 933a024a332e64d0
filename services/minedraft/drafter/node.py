"""The drafter process: the draft model, the draft worker and its end of the step channel."""

from __future__ import annotations

import time

from minedraft.api import worker_pb2
from minedraft.config import DistributedConfig, EngineConfig, num_slots
from minedraft.engine.executor import draft_runner
from minedraft.engine.workers import DraftWorker
from minedraft.scheduler_watch import SchedulerWatch
from minedraft.transport.channel import StepChannel
from minedraft.wire import plan_from_proto
from minedraft.worker_node import begin_plan, join_world, max_model_len_of, topology_of, worker_info


class DrafterNode:
    def __init__(self, config: EngineConfig, dist: DistributedConfig) -> None:
        if config.speculative_config is None:
            raise ValueError("the drafter needs a speculative config (plain autoregressive decoding has no drafter)")
        self.config = config
        device = _drafter_device(config)
        self.groups = join_world(config, dist, topology_of(config).drafter_rank, device)
        self.runner = draft_runner(config, num_slots(config), max_model_len_of(config), device)
        self.worker = DraftWorker(self.runner, support_size=config.draft_support_size)
        self.channel = StepChannel(self.groups, support_size=config.draft_support_size)
        self.watch = SchedulerWatch(dist.idle_reset_s)

    def run(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepReply:
        """Draft, then the step-end exchange: results in first, then the still-valid drafts out."""
        begin_plan(self.watch, self.worker, plan)
        admit, release, draft, verify = plan_from_proto(plan)
        self.worker.release(release)
        self.worker.admit(admit)
        reply = worker_pb2.StepReply(step_id=plan.step_id)
        if draft is not None:
            start = time.perf_counter()
            self.worker.draft(draft)
            reply.draft_seconds = time.perf_counter() - start
        if verify is not None:
            self.worker.apply_results(self.channel.recv_results([t.request_id for t in verify.tasks]))
        if draft is not None:
            windows = self.worker.take_drafts()
            self.channel.send_drafts([t.request_id for t in draft.tasks], windows)
            for request_id, window in windows.items():
                reply.drafted[request_id] = len(window.tokens)
        self.watch.step_done()
        return reply

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_info("drafter", str(self.config.draft_path), self.worker, self.groups.rank, self.config)

    def close(self) -> None:
        self.groups.close()


def _drafter_device(config: EngineConfig) -> str:
    """The GPU after the verifier's when this machine has one (one host running everything); in its own
    pod the drafter sees one GPU, cuda:0. An explicit cuda:N is used as given."""
    device = config.resolved_device()
    if device != "cuda":
        return device
    import torch

    return (
        f"cuda:{config.tensor_parallel_size}" if torch.cuda.device_count() > config.tensor_parallel_size else "cuda:0"
    )
