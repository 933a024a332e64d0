"""One verifier rank: the target model shard, the verify worker and its end of the step channel.

Every rank runs the same forward (a collective under tensor parallelism); only rank 0 samples, then
sends the results to the drafter and to the other ranks, so all ranks commit the same tokens.
"""

from __future__ import annotations

import logging
import time

from minedraft.api import worker_pb2
from minedraft.config import DistributedConfig, EngineConfig, num_batches, num_slots
from minedraft.engine.workers import VerifyWorker
from minedraft.model.runner import ModelRunner
from minedraft.scheduler_watch import SchedulerWatch
from minedraft.transport.channel import StepChannel
from minedraft.wire import plan_from_proto, verified_to_proto
from minedraft.worker_node import begin_plan, join_world, max_model_len_of, worker_info

log = logging.getLogger("minedraft.verifier")


class VerifierNode:
    def __init__(self, config: EngineConfig, dist: DistributedConfig, rank: int) -> None:
        self.config = config
        device = _rank_device(config.resolved_device(), rank)
        self.groups = join_world(config, dist, rank, device)
        self.runner = ModelRunner(
            config.target_path,
            num_slots=num_slots(config),
            max_seq_len=max_model_len_of(config),
            device=device,
            dtype=config.resolved_dtype(device),
            tp_group=self.groups.tp_group if config.tensor_parallel_size > 1 else None,
            batch_invariant=config.batch_invariant,
            slot_regions=num_batches(config),
        )
        self.worker = VerifyWorker(self.runner)
        self.channel = StepChannel(self.groups, support_size=config.draft_support_size)
        self.rank = rank
        self.watch = SchedulerWatch(dist.idle_reset_s)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def lead(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepReply:
        """Rank 0: forward the plan to the other ranks, then run it."""
        if self.config.tensor_parallel_size > 1:
            self.channel.broadcast_plan(plan.SerializeToString())
        return self.run(plan)

    def follow(self) -> None:
        """Ranks 1..tp-1: run every plan rank 0 forwards, until it forwards an empty one."""
        while True:
            data = self.channel.broadcast_plan(None)
            if not data:
                return
            plan = worker_pb2.StepPlan()
            plan.ParseFromString(data)
            self.run(plan)

    def stop_followers(self) -> None:
        if self.is_leader and self.config.tensor_parallel_size > 1:
            self.channel.broadcast_plan(b"")

    def run(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepReply:
        begin_plan(self.watch, self.worker, plan)
        admit, release, draft, verify = plan_from_proto(plan)
        self.worker.release(release)
        self.worker.admit(admit)
        reply = worker_pb2.StepReply(step_id=plan.step_id)
        if verify is not None:
            start = time.perf_counter()
            batch = self.worker.forward(verify)
            results = self.worker.sample(batch) if self.is_leader else None
            reply.verify_seconds = time.perf_counter() - start
            if self._shares_results():
                if self.is_leader:
                    self.channel.send_results(results)
                else:
                    results = self.channel.recv_results([t.request_id for t in verify.tasks])
            self.worker.commit(batch, results)
            reply.verified.extend(verified_to_proto(results))
        if draft is not None and self.groups.topology.has_drafter:
            self.worker.receive_drafts(self.channel.recv_drafts([t.request_id for t in draft.tasks]))
        self.watch.step_done()
        return reply

    def _shares_results(self) -> bool:
        return self.groups.topology.has_drafter or self.config.tensor_parallel_size > 1

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_info("verifier", str(self.config.target_path), self.worker, self.rank, self.config)

    def close(self) -> None:
        self.groups.close()


def _rank_device(device: str, rank: int) -> str:
    """Tensor-parallel rank r uses GPU r of its pod; CPU ranks share the CPU."""
    return f"cuda:{rank}" if device == "cuda" else device
