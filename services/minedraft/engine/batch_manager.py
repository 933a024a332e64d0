"""Waiting queue and running batches (two of them in MineDraft mode), admitted by free KV blocks."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from minedraft.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class BlockBudget:
    """The KV blocks every worker can hold (the smaller of the drafter's and the verifier's pools).

    A request is charged the blocks it can fill by the end of the next step: its tokens so far, the draft
    tokens the verifier holds for it, and `lookahead` more (k draft tokens + 1), never more than
    max_model_len. Decided here, once; the workers only follow.
    """

    num_blocks: int
    block_size: int
    lookahead: int
    max_model_len: int

    def blocks(self, request: Request) -> int:
        tokens = len(request.prompt_ids) + len(request.output_ids) + (request.pending_drafts or 0) + self.lookahead
        return -(-min(tokens, self.max_model_len) // self.block_size)


class BatchManager:
    """Holds the waiting queue and up to two running batches of at most `max_num_seqs` requests each."""

    def __init__(self, num_batches: int, max_num_seqs: int, budget: BlockBudget | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.budget = budget
        self.waiting: deque[Request] = deque()
        self.batches: list[list[Request]] = [[] for _ in range(num_batches)]

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_running(self) -> int:
        return sum(len(b) for b in self.batches)

    def admit_into(self, index: int) -> list[Request]:
        """Move waiting requests into batch `index` while it has room."""
        batch = self.batches[index]
        admitted = []
        while self.waiting and len(batch) < self.max_num_seqs and self._fits(self.waiting[0]):
            admitted.append(self._start(self.waiting.popleft(), index))
        return admitted

    def admit_balanced(self, prefer: int = 0) -> list[Request]:
        """Each waiting request goes to the smaller batch (`prefer` on a tie)."""
        admitted = []
        while self.waiting:
            index = min(range(len(self.batches)), key=lambda i: (len(self.batches[i]), i != prefer))
            if len(self.batches[index]) >= self.max_num_seqs or not self._fits(self.waiting[0]):
                break
            admitted.append(self._start(self.waiting.popleft(), index))
        return admitted

    @property
    def used_blocks(self) -> int:
        budget = self.budget
        return sum(budget.blocks(r) for b in self.batches for r in b) if budget else 0

    def preempt_to_fit(self) -> list[Request]:
        """While the running requests could outgrow the pool in the next step, send the newest back to
        the front of the queue (its KV is dropped; it is prefilled again with its tokens so far)."""
        preempted: list[Request] = []
        if self.budget is None:
            return preempted
        used = self.used_blocks
        while used > self.budget.num_blocks:
            batch, newest = max(((b, r) for b in self.batches for r in b), key=lambda pair: pair[1].arrival_time)
            used -= self.budget.blocks(newest)
            batch.remove(newest)
            newest.restart()
            preempted.append(newest)
        self.waiting.extendleft(sorted(preempted, key=lambda r: r.arrival_time, reverse=True))
        return preempted

    def _fits(self, request: Request) -> bool:
        budget = self.budget
        return budget is None or self.used_blocks + budget.blocks(request) <= budget.num_blocks

    def remove_finished(self) -> list[Request]:
        """Take finished (or aborted) requests out of their batch and return them."""
        done = []
        for batch in self.batches:
            done.extend(r for r in batch if r.finished)
            batch[:] = [r for r in batch if not r.finished]
        return done

    def abort_waiting(self, request_id: str) -> Request | None:
        request = self.take_waiting(request_id)
        if request is not None:
            request.abort()
        return request

    def take_waiting(self, request_id: str) -> Request | None:
        """Out of the waiting queue, unchanged (to be queued again later)."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return request
        return None

    def _start(self, request: Request, index: int) -> Request:
        request.status = RequestStatus.RUNNING
        if request.scheduled_time is None:  # a preempted request keeps its first
            request.scheduled_time = time.monotonic()
        request.batch = index
        self.batches[index].append(request)
        return request
