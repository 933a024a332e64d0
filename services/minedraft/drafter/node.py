"""The drafter process: the draft model, the draft worker and its end of the step channel."""

from __future__ import annotations

import logging
import time

from minedraft.api import worker_pb2
from minedraft.config import DistributedConfig, EngineConfig, num_slots
from minedraft.engine.adaptive.threads import StepThreads
from minedraft.engine.eagle_drafter import EagleDraftWorker
from minedraft.engine.local_executor import build_drafter
from minedraft.engine.plans import VerifyPlan
from minedraft.transport.channel import StepChannel
from minedraft.transport.groups import WorldGroups, rendezvous_store
from minedraft.wire import lora_adapter_from_proto, lora_changes_from_proto, plan_from_proto
from minedraft.worker_node import (
    MissedResults,
    check_epoch,
    defers_results,
    join_world,
    max_model_len_of,
    topology_of,
    worker_info,
)

log = logging.getLogger("minedraft.drafter")


class DrafterNode:
    def __init__(self, config: EngineConfig, dist: DistributedConfig, threads_beside: int = 0) -> None:
        if config.speculative_config is None:
            raise ValueError("the drafter needs a speculative config (plain autoregressive decoding has no drafter)")
        self.config = config
        self.dist = dist
        self.device = _drafter_device(config)
        self.worker = build_drafter(config, num_slots(config), max_model_len_of(config), self.device)
        self.threads = StepThreads(self.device, threads_beside)
        self.rank = topology_of(config).drafter_rank
        self.groups: WorldGroups | None = None
        self.channel: StepChannel | None = None
        self.epoch: int | None = None
        self.missed = MissedResults(lambda request_id: request_id)  # the results the verifier holds for it

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
        self.channel = StepChannel(self.groups, support_size=self.config.draft_support_size)
        self.epoch = request.epoch

    def leave(self) -> None:
        self.worker.reset()
        self.missed.take()
        self.epoch, self.channel = None, None
        if self.groups is not None:
            self.groups.close()
            self.groups = None

    def step(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepReply:
        """Draft, then the step-end exchange: results in first, then the still-valid drafts out (a plan that
        drafts after the verification takes the results first). A step that drafts nothing is answered at once:
        its results come with the next step that drafts (MissedResults)."""
        check_epoch(self.epoch, plan)
        admit, release, draft, verify = plan_from_proto(plan)
        self.worker.release(release)
        self.missed.drop(release)
        loaded = self.worker.change_loras(lora_changes_from_proto(plan))
        self.worker.admit(admit)
        results_first = draft is not None and verify is not None and draft.after_verify
        reply = worker_pb2.StepReply(step_id=plan.step_id, lora_loaded=loaded, draft_after_verify=results_first)
        if draft is not None:
            missed = self.missed.take()
            if missed:
                self.worker.apply_results(self.channel.recv_results(missed))
            if results_first:  # one-batch speculation: the windows follow this step's verification
                self._take_results(verify)
            self.threads.use(together=verify is not None and not results_first, requests=len(draft.tasks),
                             prefill=bool(draft.prefill), tokens=draft.num_tokens)
            start = time.perf_counter()
            self.worker.draft(draft)
            reply.draft_seconds = time.perf_counter() - start
            self.threads.done(reply.draft_seconds)
            reply.thread_trial = self.threads.trying
            reply.draft_forwards, reply.draft_tokens = self.worker.take_work()
        if verify is not None and draft is None and defers_results(self.config):
            self.missed.add(t.request_id for t in verify.tasks)
        elif verify is not None and not results_first:
            self._take_results(verify)
        if draft is not None:
            windows = self.worker.take_drafts()
            self.channel.send_drafts([t.request_id for t in draft.tasks], windows)
            for request_id, window in windows.items():
                reply.drafted[request_id] = len(window.tokens)
        reply.prefix_cache_queries, reply.prefix_cache_hits = self.worker.take_prefix_stats()
        return reply

    def _take_results(self, verify: VerifyPlan) -> None:
        """The step's verified tokens from the verifier (and an EAGLE head's features), applied."""
        self.worker.apply_results(self.channel.recv_results([t.request_id for t in verify.tasks]))
        if isinstance(self.worker, EagleDraftWorker):
            self.worker.receive_features(self.channel.recv_features(verify.request_ids()))

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
