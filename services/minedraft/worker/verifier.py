"""`minedraft verifier`: one verifier rank per process, the target model shard, the verify worker and its end of
the step channel; rank 0 serves the Worker gRPC API, ranks 1..tp-1 run as its child processes.

Every rank runs the same forward (a collective under tensor parallelism); only rank 0 samples, then
sends the results to the drafter and to the other ranks, so all ranks commit the same tokens.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import sys
import threading

from minedraft.api import worker_pb2
from minedraft.config import DistributedConfig, EngineConfig, num_slots
from minedraft.engine.adaptive.threads import StepThreads
from minedraft.engine.plans import Drafts, Verified
from minedraft.engine.runners import target_runner
from minedraft.engine.step import Features, VerifySide, defers_results
from minedraft.engine.workers import VerifyWorker
from minedraft.pool import check_poolable
from minedraft.pool.link import Inbox, Peer, PoolLink
from minedraft.service.lifetime import die_with_parent, wait_for_termination
from minedraft.settings import WorkerSettings
from minedraft.transport.channel import StepChannel
from minedraft.transport.groups import WorldGroups, rendezvous_store
from minedraft.wire import drafts_from_exchange, lora_adapter_from_proto, plan_from_proto, step_reply
from minedraft.worker.node import NotInWorld, check_epoch, join_world, worker_info
from minedraft.worker.pair import PairNode
from minedraft.worker.servicer import NodeServicer, start_worker_server

log = logging.getLogger("minedraft.verifier")


class VerifierNode:
    """A verifier rank's side of every step (engine/step.py), its end of the channel a `RankEnd`."""

    def __init__(self, config: EngineConfig, dist: DistributedConfig, rank: int, threads_beside: int = 0) -> None:
        self.config = config
        self.dist = dist
        self.rank = rank
        self.device = _rank_device(config.resolved_device(), rank)
        # Rank 0 hosts the rendezvous for its whole life; its other ranks and the drafter connect to it.
        self.store = rendezvous_store(
            dist.master_addr, dist.master_port, is_master=rank == 0, timeout_s=dist.timeout_s, host=dist.store_host
        )
        # Tensor-parallel ranks meet once at start to load their shards; each later world rebinds the group.
        self.groups: WorldGroups | None = None
        if config.tensor_parallel_size > 1:
            self.groups = join_world(config, dist, rank, self.device, store=self.store, epoch="load", has_drafter=False)
        self.runner = target_runner(config, num_slots(config), self.device,
                                    tp_group=self.groups.tp_group if self.groups else None)  # fmt: skip
        self.worker = VerifyWorker(self.runner)
        self.side = VerifySide(self.worker, threads=StepThreads(self.device, threads_beside),
                               defers=defers_results(config), features=config.uses_eagle_head)  # fmt: skip
        self.channel = StepChannel(self.groups, config.draft_support_size) if self.groups else None
        self.epoch: int | None = None
        # A drafter of a pool (JoinRequest.drafter_address) is in no world: rank 0 hands over through `pool`.
        self.pooled = False
        self.inbox = Inbox()
        self.pool: PoolLink | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def join(self, request: worker_pb2.JoinRequest) -> None:
        """Rank 0: take the other ranks along into the new world, then join it."""
        if self.config.tensor_parallel_size > 1:
            self._forward(worker_pb2.FollowerMessage(join=request))
        self._join(request)

    def _join(self, request: worker_pb2.JoinRequest) -> None:
        """Drop every request and form the new world: the verifier ranks, and the drafter if there is one.
        A lone verifier rank without a drafter needs no world at all."""
        self.worker.reset()
        self.pooled = bool(request.drafter_address)
        if self.pooled:
            check_poolable(self.config)
        drafts = request.has_drafter or self.pooled
        self.worker.prediction_window = 0 if drafts else self.config.prediction_draft_tokens
        self.side.missed.take()
        self.epoch, self.channel, self.side.end = None, None, None
        self._leave_pool()
        for name, error in self.worker.set_loras([lora_adapter_from_proto(m) for m in request.lora_adapters]).items():
            log.error("verifier rank %d cannot serve LoRA adapter %r: %s", self.rank, name, error)
        if self.groups is not None:
            self.groups.close()
            self.groups = None
        if self.config.tensor_parallel_size > 1 or request.has_drafter:
            self.groups = join_world(self.config, self.dist, self.rank, self.device, store=self.store,
                                     epoch=request.epoch, has_drafter=request.has_drafter)
            self.channel = StepChannel(self.groups, support_size=self.config.draft_support_size)
            if self.config.tensor_parallel_size > 1:
                self.runner.tp.bind(self.groups.tp_group)
        if self.pooled and self.is_leader:
            self.inbox.open(request.epoch)
            self.pool = PoolLink(Peer(request.drafter_address), self.inbox, request.epoch,
                                 self.config.draft_support_size, self.dist.timeout_s)  # fmt: skip
        drafting = self.pooled or self.groups is not None and self.groups.topology.has_drafter
        self.side.end = RankEnd(self.channel, self.pool, self.is_leader, drafting, self.pooled,
                                self.config.draft_support_size, self.device)  # fmt: skip
        self.epoch = request.epoch

    def _leave_pool(self) -> None:
        self.inbox.close()
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def interrupt(self) -> None:
        """A new world is coming: a step waiting for the pool drafter's windows gives up now."""
        self.inbox.close()

    def deliver(self, message: worker_pb2.ExchangeMessage) -> None:
        """The pool drafter's windows (an Exchange call), for the step that waits for them."""
        if not self.inbox.put(message):
            raise NotInWorld(f"the verifier is not in epoch {message.epoch} with a pool drafter")

    def step(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepReply:
        """Rank 0 (the one the scheduler talks to): forward the plan to the other ranks, then run it."""
        check_epoch(self.epoch, plan)
        if self.config.tensor_parallel_size > 1:
            self._forward(worker_pb2.FollowerMessage(plan=plan))
        return self._run(plan)

    def _forward(self, message: worker_pb2.FollowerMessage) -> None:
        self.channel.broadcast_plan(message.SerializeToString())

    def follow(self) -> None:
        """Ranks 1..tp-1: run every plan and join every world rank 0 forwards, until it forwards an empty
        message or is gone. A failed step (the drafter died in its exchange) waits for the next world."""
        while True:
            try:
                data = self.channel.broadcast_plan(None)
            except Exception:  # rank 0 is gone: so is this verifier
                log.exception("verifier rank %d lost rank 0", self.rank)
                return
            if not data:
                return
            message = worker_pb2.FollowerMessage.FromString(data)
            if message.HasField("join"):
                self._join(message.join)
                continue
            try:
                self._run(message.plan)
            except Exception:
                log.exception("verifier rank %d: a step failed; waiting for a new world", self.rank)

    def stop_followers(self) -> None:
        if self.is_leader and self.channel is not None and self.config.tensor_parallel_size > 1:
            self.channel.broadcast_plan(b"")

    def _run(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepReply:
        return step_reply(plan.step_id, self.side.step(plan_from_proto(plan)), "verifier")

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_info("verifier", str(self.config.target_path), self.worker, self.rank, self.config, self.epoch)

    def close(self) -> None:
        self.worker.reset()
        self._leave_pool()
        if self.groups is not None:
            self.groups.close()


def _rank_device(device: str, rank: int) -> str:
    """Tensor-parallel rank r uses GPU r of its pod; CPU ranks share the CPU."""
    return f"cuda:{rank}" if device == "cuda" else device


class RankEnd:
    """A verifier rank's end of the step-end exchange (engine/step.py, VerifierEnd): the world's StepChannel to
    the drafter and the other ranks, or, with a pool drafter, Exchange calls from rank 0 (`pool`), which hands
    the drafter's windows on to the other ranks over the channel."""

    def __init__(self, channel: StepChannel | None, pool: PoolLink | None, leader: bool, drafting: bool,
                 pooled: bool, support_size: int, device: str) -> None:  # fmt: skip
        self.channel, self.pool, self.leader, self.drafting = channel, pool, leader, drafting
        self.pooled, self.support_size, self.device = pooled, support_size, device

    def send_missed(self, results: list[Verified]) -> None:
        if self.pooled:
            self.pool.send_results(results)
        else:
            self.channel.send_missed_results(results)

    def share_results(self, results: list[Verified] | None, request_ids: list[str],
                      to_drafter: bool) -> list[Verified]:  # fmt: skip
        if self.leader and self.pooled and to_drafter:
            self.pool.send_results(results)
        if self.channel is None:
            return results
        if self.leader:  # the drafter and the other ranks commit the same tokens
            self.channel.send_results(results, to_drafter=to_drafter)
            return results
        return self.channel.recv_results(request_ids)

    def send_features(self, request_ids: list[str], features: Features, width: int) -> None:
        self.channel.send_features(request_ids, features, width)

    def recv_drafts(self, request_ids: list[str]) -> dict[str, Drafts]:
        if not self.pooled:
            return self.channel.recv_drafts(request_ids)
        if self.leader:  # rank 0 receives the pool drafter's windows and hands the message on to its other ranks
            message = self.pool.recv_drafts_message(request_ids)
            if self.channel is not None:
                self.channel.broadcast_plan(message.SerializeToString())
        else:
            message = worker_pb2.ExchangeMessage.FromString(self.channel.broadcast_plan(None))
        return drafts_from_exchange(message, self.support_size, self.device)


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


def _exit_when_a_follower_dies(followers: list[mp.process.BaseProcess], stopping: threading.Event) -> None:
    """A rank that died leaves the others unable to form a world again (each join fails on its missing peer): end
    the whole verifier, so that whoever started it (`minedraft up`, the kubelet) starts all its ranks anew."""
    ended = multiprocessing.connection.wait([process.sentinel for process in followers])
    if stopping.is_set():
        return
    dead = next(process for process in followers if process.sentinel in ended)
    dead.join()
    log.error("%s exited with code %s; stopping this verifier so that all its ranks start again", dead.name,
              dead.exitcode)  # fmt: skip
    for process in followers:
        if process.is_alive():
            process.kill()
    os._exit(1)


def serve_verifier(
    config: EngineConfig, dist: DistributedConfig, settings: WorkerSettings, host: str, port: int
) -> None:
    # A CPU rank forks its followers before it has started a thread pool, a gRPC server or a model: they skip a
    # fresh interpreter's imports. CUDA cannot be used across fork, so GPU followers start fresh.
    forked = config.resolved_device() == "cpu" and sys.platform.startswith("linux")
    followers = [
        mp.get_context("fork" if forked else "spawn").Process(
            target=_follower_main,
            args=(config.model_dump_json(), dist.model_dump_json(), rank, settings.cpu_threads_beside),
            name=f"verifier-rank-{rank}",
            daemon=True,
        )
        for rank in range(1, config.tensor_parallel_size)
    ]
    for process in followers:
        process.start()
    stopping = threading.Event()
    if followers:
        threading.Thread(target=_exit_when_a_follower_dies, args=(followers, stopping), name="follower-watch",
                         daemon=True).start()  # fmt: skip
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
        stopping.set()
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
