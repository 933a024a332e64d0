"""A drafter of a pool: one draft model serving the drafting of several engine groups.

Each group joins with its own world (an epoch) and its own step stream, and hands drafts and results over
with its verifier through Exchange calls (pool/link.py). The draft worker, its KV pool and its prefix cache are
shared: a group's requests are held under ids scoped by the group, and the draft parts of the groups that wait
for the model at the same time run as one plan, in shared forwards (each group's reply tells the shared
forwards' work, which is what its part cost). Everything a step waits for (its verifier's results) is waited
for outside the model's lock, so a group whose verifier is slow never holds up the others.

A group's scheduler admits by its share of the KV pool (the pool's blocks over the groups it may serve), so
the groups together never ask for more than the pool holds.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import replace

from minedraft.api import worker_pb2
from minedraft.config import EngineConfig, num_slots
from minedraft.engine.local_executor import build_drafter
from minedraft.engine.plans import Admission, DraftPlan, Verified, VerifyPlan
from minedraft.pool import check_poolable
from minedraft.pool.link import Inbox, Peer, PoolLink
from minedraft.wire import plan_from_proto
from minedraft.worker_node import MissedResults, NotInWorld, defers_results, max_model_len_of

log = logging.getLogger("minedraft.pool")


class PoolFull(RuntimeError):
    """A group asked to join a member that serves as many groups as it may."""


class _Ticket:
    """One group's draft part, waiting for the model; filled in by whoever drafts it."""

    def __init__(self, plan: DraftPlan) -> None:
        self.plan = plan
        self.asked = self.started = time.perf_counter()
        self.seconds = 0.0
        self.work = (0, 0)  # forwards and tokens of the forward it shared
        self.done = False


class _Group:
    """One group's world at this member: its scoped request ids, its link to the verifier, the results owed."""

    def __init__(self, name: str, index: int, epoch: int, link: PoolLink) -> None:
        self.name, self.epoch, self.link = name, epoch, link
        self.prefix = f"{index}/"
        self.missed = MissedResults(lambda request_id: request_id)

    def owns(self, request_id: str) -> bool:
        return request_id.startswith(self.prefix)

    def scoped(self, request_id: str) -> str:
        return self.prefix + request_id

    def unscoped(self, request_id: str) -> str:
        return request_id[len(self.prefix) :]


class PoolMember:
    """The WorkerNode of a pool drafter (see worker_node.WorkerNode), stepping several groups at once."""

    def __init__(self, config: EngineConfig, capacity: int, timeout_s: float) -> None:
        check_poolable(config)
        if capacity < 1:
            raise ValueError(f"a pool drafter serves at least one group, got pool_groups={capacity}")
        self.config, self.capacity, self.timeout_s = config, capacity, timeout_s
        device = "cpu" if config.drafts_without_model else config.resolved_device()
        self.worker = build_drafter(config, num_slots(config) * capacity, max_model_len_of(config), device)
        self._groups: dict[int, _Group] = {}  # by epoch
        self._inboxes: dict[int, Inbox] = {}
        self._state = threading.Lock()  # guards the two maps above
        self._model = threading.Lock()  # one group's work on the shared worker at a time
        self._count = threading.Lock()  # guards _pending (taken with or without the model's lock, never _state)
        self._pending: list[_Ticket] = []  # draft parts waiting for the model
        self.joint_parts = 0  # draft parts drafted in one plan with another group's
        self._indexes = itertools.count()

    # -- worlds ---------------------------------------------------------------------------------------------

    def join(self, request: worker_pb2.JoinRequest) -> None:
        """A group's new world: its old one here (by name) is dropped first; a new group takes a free place."""
        if not request.group or not request.verifier_address:
            raise ValueError("a pool drafter is joined by a group that names itself and its verifier's address")
        with self._state:
            old = [g.epoch for g in self._groups.values() if g.name == request.group]
            for epoch in old:
                self._drop(epoch)
            if len(self._groups) >= self.capacity:
                raise PoolFull(f"this pool drafter serves {len(self._groups)} groups, as many as it may "
                               f"(--pool-groups {self.capacity})")  # fmt: skip
            inbox = Inbox()
            inbox.open(request.epoch)
            link = PoolLink(Peer(request.verifier_address), inbox, request.epoch, self.config.draft_support_size,
                            self.timeout_s)  # fmt: skip
            self._groups[request.epoch] = _Group(request.group, next(self._indexes), request.epoch, link)
            self._inboxes[request.epoch] = inbox
        log.info("group %s joined (epoch %d, verifier %s); %d of %d places taken", request.group, request.epoch,
                 request.verifier_address, len(self._groups), self.capacity)  # fmt: skip

    def leave(self, epoch: int) -> None:
        """A group's step stream ended: its world is over (it joins again, here or elsewhere, before it steps)."""
        with self._state:
            group = self._groups.get(epoch)
            self._drop(epoch)
        if group is not None:
            log.info("group %s left (epoch %d)", group.name, epoch)

    def _drop(self, epoch: int) -> None:
        group = self._groups.pop(epoch, None)
        inbox = self._inboxes.pop(epoch, None)
        if inbox is not None:
            inbox.close()
        if group is not None:
            group.link.close()
            with self._model:
                self.worker.release([r for r in self.worker.sequences if group.owns(r)])

    def deliver(self, message: worker_pb2.ExchangeMessage) -> None:
        """An Exchange call from a group's verifier: its results, for the step that waits for them."""
        inbox = self._inboxes.get(message.epoch)
        if inbox is None or not inbox.put(message):
            raise NotInWorld(f"no group here is in epoch {message.epoch}")

    # -- steps ----------------------------------------------------------------------------------------------

    def step(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepReply:
        """The drafter's step (drafter/node.py) for one group: admissions, draft, the results in, the windows out."""
        group = self._groups.get(plan.epoch)
        if group is None:
            raise NotInWorld(f"step {plan.step_id} is for epoch {plan.epoch}; no group here is in it")
        admit, release, draft, verify = _scoped(group, *plan_from_proto(plan))
        results_first = draft is not None and verify is not None and draft.after_verify
        reply = worker_pb2.StepReply(step_id=plan.step_id, draft_after_verify=results_first)
        with self._model:
            self.worker.release(release)
            self.worker.admit(admit)
            reply.prefix_cache_queries, reply.prefix_cache_hits = self.worker.take_prefix_stats()
        group.missed.drop(release)
        if draft is not None:
            missed = group.missed.take()
            if missed:
                self._apply(group, missed)
            if results_first:
                self._apply(group, [t.request_id for t in verify.tasks])
            self._draft(draft, reply)
        if verify is not None and draft is None and defers_results(self.config):
            group.missed.add(t.request_id for t in verify.tasks)
        elif verify is not None and not results_first:
            self._apply(group, [t.request_id for t in verify.tasks])
        if draft is not None:
            with self._model:
                windows = self.worker.take_drafts(owns=group.owns)
            ids = [group.unscoped(t.request_id) for t in draft.tasks]
            group.link.send_drafts(ids, {group.unscoped(r): w for r, w in windows.items()})
            for request_id, window in windows.items():
                reply.drafted[group.unscoped(request_id)] = len(window.tokens)
        return reply

    def _apply(self, group: _Group, scoped_ids: list[str]) -> None:
        """Wait for the verifier's results of these requests (outside the model's lock), then apply them."""
        results = group.link.recv_results([group.unscoped(r) for r in scoped_ids])
        scoped = [Verified(group.scoped(v.request_id), v.token_ids, v.num_draft_tokens, v.num_accepted)
                  for v in results]  # fmt: skip
        with self._model:
            self.worker.apply_results(scoped)

    def _draft(self, draft: DraftPlan, reply: worker_pb2.StepReply) -> None:
        """Draft this group's part, in one forward with the parts of other groups that wait for the model too
        (the first to get the model drafts every waiting part; the others find theirs done)."""
        ticket = _Ticket(draft)
        with self._count:
            reply.pool_queue = len(self._pending)
            self._pending.append(ticket)
        with self._model:
            if not ticket.done:
                self._draft_together(ticket)
        reply.pool_wait_seconds = ticket.started - ticket.asked
        reply.draft_seconds = ticket.seconds
        reply.draft_forwards, reply.draft_tokens = ticket.work

    def _draft_together(self, ticket: _Ticket) -> None:
        """With the model's lock: every waiting part as one plan (a Tetris plan, which selects over its own batch,
        alone). The windows land in the shared worker, where each group takes its own."""
        with self._count:
            if ticket.plan.tetris_capacity is None:
                batch = [t for t in self._pending if t.plan.tetris_capacity is None]
            else:
                batch = [ticket]
            self._pending = [t for t in self._pending if t not in batch]
        start = time.perf_counter()
        plans = [t.plan for t in batch]
        merged = replace(plans[0], tasks=[task for p in plans for task in p.tasks],
                         prefill=[chunk for p in plans for chunk in p.prefill])  # fmt: skip
        self.worker.draft(merged)
        seconds, work = time.perf_counter() - start, self.worker.take_work()
        for done in batch:
            done.started, done.seconds, done.work, done.done = start, seconds, work, True
        if len(batch) > 1:
            self.joint_parts += len(batch)

    # -- what it tells the schedulers -----------------------------------------------------------------------

    def info(self) -> worker_pb2.WorkerInfo:
        """Like a drafter's, with the KV pool a group's share of it, and the pool's load."""
        worker, config = self.worker, self.config
        runner = worker.runner
        share = (worker.kv_blocks or 0) // self.capacity
        info = worker_pb2.WorkerInfo(
            role="drafter", model=str(config.draft_path), block_size=config.block_size,
            num_active_sequences=worker.num_active, max_model_len=worker.max_seq_len,
            tensor_parallel_size=config.tensor_parallel_size, engine_config_json=config.model_dump_json(),
            num_blocks=share, pool_capacity=self.capacity, pool_groups=len(self._groups), pool_queue=len(self._pending),
            pool_joint_parts=self.joint_parts,
        )  # fmt: skip
        if runner is not None:
            info.vocab_size = runner.config.vocab_size
            info.eos_token_ids.extend(runner.config.eos_token_ids)
            info.num_free_blocks = runner.num_free_blocks
        return info

    def close(self) -> None:
        with self._state:
            for epoch in list(self._groups):
                self._drop(epoch)


def _scoped(
    group: _Group, admit: list[Admission], release: list[str], draft: DraftPlan | None, verify: VerifyPlan | None
) -> tuple[list[Admission], list[str], DraftPlan | None, VerifyPlan | None]:
    """The plan's parts with every request id scoped by the group (ids of two groups may be equal)."""
    scope = group.scoped
    admit = [replace(a, request_id=scope(a.request_id)) for a in admit]
    release = [scope(r) for r in release]
    if draft is not None:
        draft = replace(draft, tasks=_rescoped(draft.tasks, scope), prefill=_rescoped(draft.prefill, scope))
    if verify is not None:
        verify = replace(verify, tasks=_rescoped(verify.tasks, scope), prefill=_rescoped(verify.prefill, scope))
    return admit, release, draft, verify


def _rescoped(items: Iterable, scope) -> list:
    return [replace(item, request_id=scope(item.request_id)) for item in items]
