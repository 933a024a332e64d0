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
from minedraft.engine.plans import DraftPlan, Drafts, StepResult, Verified
from minedraft.engine.runners import build_drafter, max_model_len
from minedraft.engine.step import DraftSide, Features, StepPlan, defers_results
from minedraft.pool import check_poolable
from minedraft.pool.link import Inbox, Peer, PoolLink
from minedraft.wire import plan_from_proto, step_reply
from minedraft.worker.node import NotInWorld

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
    """One group's world at this member: its scoped request ids, and its link to the verifier, the end of the
    channel of its drafter side (engine/step.py, DrafterEnd) with the ids unscoped on the way."""

    def __init__(self, name: str, index: int, epoch: int, link: PoolLink) -> None:
        self.name, self.epoch, self.link = name, epoch, link
        self.prefix = f"{index}/"
        self.side: DraftSide | None = None  # set by the member it joins

    def owns(self, request_id: str) -> bool:
        return request_id.startswith(self.prefix)

    def scoped(self, request_id: str) -> str:
        return self.prefix + request_id

    def unscoped(self, request_id: str) -> str:
        return request_id[len(self.prefix) :]

    def recv_results(self, request_ids: list[str]) -> list[Verified]:
        results = self.link.recv_results([self.unscoped(r) for r in request_ids])
        return [Verified(self.scoped(v.request_id), v.token_ids, v.num_draft_tokens, v.num_accepted) for v in results]

    def recv_features(self, request_ids: list[str]) -> Features:
        raise RuntimeError("a pool drafter drafts without the target's features (check_poolable)")

    def send_drafts(self, request_ids: list[str], windows: dict[str, Drafts]) -> None:
        self.link.send_drafts([self.unscoped(r) for r in request_ids],
                              {self.unscoped(r): w for r, w in windows.items()})  # fmt: skip


class _GroupSide(DraftSide):
    """A group's drafter side on the member's shared worker: its calls under the model's lock, its windows its own
    requests', its draft part drafted with the other groups' that wait for the model (PoolMember._draft)."""

    def __init__(self, member: PoolMember, group: _Group) -> None:
        super().__init__(member.worker, end=group, defers=defers_results(member.config), lock=member._model,
                         owns=group.owns)  # fmt: skip
        self._member = member

    def _draft(self, draft: DraftPlan, together: bool, result: StepResult) -> None:
        self._member._draft(draft, result)


class PoolMember:
    """The WorkerNode of a pool drafter (see worker/node.py, WorkerNode), stepping several groups at once."""

    def __init__(self, config: EngineConfig, capacity: int, timeout_s: float) -> None:
        check_poolable(config)
        if capacity < 1:
            raise ValueError(f"a pool drafter serves at least one group, got pool_groups={capacity}")
        self.config, self.capacity, self.timeout_s = config, capacity, timeout_s
        device = "cpu" if config.drafts_without_model else config.resolved_device()
        self.worker = build_drafter(config, num_slots(config) * capacity, max_model_len(config), device)
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
            group = _Group(request.group, next(self._indexes), request.epoch, link)
            group.side = _GroupSide(self, group)
            self._groups[request.epoch] = group
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
        """The drafter's step (engine/step.py) for one group: admissions, draft, the results in, the windows out."""
        group = self._groups.get(plan.epoch)
        if group is None:
            raise NotInWorld(f"step {plan.step_id} is for epoch {plan.epoch}; no group here is in it")
        result = group.side.step(_scoped(group, plan_from_proto(plan)))
        result.drafted = {group.unscoped(r): n for r, n in result.drafted.items()}
        return step_reply(plan.step_id, result, "drafter")

    def _draft(self, draft: DraftPlan, result: StepResult) -> None:
        """Draft this group's part, in one forward with the parts of other groups that wait for the model too
        (the first to get the model drafts every waiting part; the others find theirs done)."""
        ticket = _Ticket(draft)
        with self._count:
            result.drafter_queue = len(self._pending)
            self._pending.append(ticket)
        with self._model:
            if not ticket.done:
                self._draft_together(ticket)
        result.drafter_wait_seconds = ticket.started - ticket.asked
        result.draft_seconds = ticket.seconds
        result.draft_forwards, result.fed_to_draft = ticket.work

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


def _scoped(group: _Group, plan: StepPlan) -> StepPlan:
    """The plan with every request id scoped by the group (ids of two groups may be equal)."""
    scope, draft, verify = group.scoped, plan.draft, plan.verify
    if draft is not None:
        draft = replace(draft, tasks=_rescoped(draft.tasks, scope), prefill=_rescoped(draft.prefill, scope))
    if verify is not None:
        verify = replace(verify, tasks=_rescoped(verify.tasks, scope), prefill=_rescoped(verify.prefill, scope))
    return replace(plan, admit=_rescoped(plan.admit, scope), release=[scope(r) for r in plan.release], draft=draft,
                   verify=verify)  # fmt: skip


def _rescoped(items: Iterable, scope) -> list:
    return [replace(item, request_id=scope(item.request_id)) for item in items]
