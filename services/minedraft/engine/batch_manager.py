"""Waiting queue and running batches (two of them in MineDraft mode), admitted by free KV blocks."""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import Counter, deque
from dataclasses import dataclass

from minedraft.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class BlockBudget:
    """The KV blocks the workers hold: the verifier's pool (every tensor-parallel rank holds the same) and the
    drafter's, when there is one. Decided here, once; the workers only follow.

    A request is charged the blocks it can fill by the end of the next step: its tokens so far, the draft
    tokens the verifier holds for it, and `lookahead` more (k draft tokens + 1), never more than
    max_model_len. With `shares_prefixes` (the verifier's prefix cache is on) the verifier's pool counts a
    block that running requests share once: a request admitted while others hold the full blocks its tokens
    start with takes those blocks from the verifier's cache, and is charged only for the rest. The drafter's
    pool is charged in full (its cache can lag: it writes a request's tokens only when it drafts them).
    """

    num_blocks: int
    block_size: int
    lookahead: int
    max_model_len: int
    draft_blocks: int | None = None
    shares_prefixes: bool = False
    prediction_lookahead: int = 0  # more for a request with a prediction that the verifier drafts from itself

    def blocks(self, request: Request) -> int:
        extra = self.prediction_lookahead if request.prediction_ids else 0
        tokens = request.num_tokens + (request.pending_drafts or 0) + self.lookahead + extra
        return -(-min(tokens, self.max_model_len) // self.block_size)


def chain_keys(token_ids: list[int], block_size: int, lora: str | None = None) -> list[bytes]:
    """A key per full block below the last token (those a worker may take from its prefix cache): a digest
    of the block's tokens and the key before it, so equal keys mean equal prefixes. A LoRA adapter's
    requests start from their own key: their blocks hold other keys and values (the workers' caches agree)."""
    keys, key = [], b"" if lora is None else hashlib.sha256(b"lora:" + lora.encode()).digest()
    for start in range(0, len(token_ids) - block_size, block_size):
        key = hashlib.sha256(key + array("q", token_ids[start : start + block_size]).tobytes()).digest()
        keys.append(key)
    return keys


class BatchManager:
    """Holds the waiting queue and up to two running batches of at most `max_num_seqs` requests each."""

    def __init__(self, num_batches: int, max_num_seqs: int, budget: BlockBudget | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.budget = budget
        self.max_loras: int | None = None  # distinct LoRA adapters the running requests may use (None: no LoRA)
        self.waiting: deque[Request] = deque()
        self.batches: list[list[Request]] = [[] for _ in range(num_batches)]
        # Keys of the blocks running requests share from the verifier's cache, by how many requests hold each.
        self._shared: Counter[bytes] = Counter()

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
        """The verifier's blocks the running requests can fill by the end of the next step, shared ones once."""
        return self._used()[0]

    def _used(self) -> tuple[int, int]:
        """(verifier blocks, drafter blocks) charged to the running requests."""
        budget = self.budget
        if budget is None:
            return 0, 0
        full = sum(budget.blocks(r) for b in self.batches for r in b)
        shared = sum(r.shared_blocks for b in self.batches for r in b)
        return full - shared + len(self._shared), full

    def preempt_to_fit(self) -> list[Request]:
        """While the running requests could outgrow a pool in the next step, send the newest back to the
        front of the queue (its KV is dropped; it is prefilled again with its tokens so far)."""
        preempted: list[Request] = []
        if self.budget is None:
            return preempted
        while self.num_running and not self._within_pools(*self._used()):
            batch, newest = max(((b, r) for b in self.batches for r in b), key=lambda pair: pair[1].arrival_time)
            batch.remove(newest)
            self._unshare(newest)
            newest.restart()
            preempted.append(newest)
        self.waiting.extendleft(sorted(preempted, key=lambda r: r.arrival_time, reverse=True))
        return preempted

    def _within_pools(self, verifier: int, drafter: int) -> bool:
        budget = self.budget
        return verifier <= budget.num_blocks and (budget.draft_blocks is None or drafter <= budget.draft_blocks)

    def _fits(self, request: Request) -> bool:
        return self._adapter_fits(request) and self._blocks_fit(request)

    def _adapter_fits(self, request: Request) -> bool:
        """At most max_loras adapters run at once (both batches: the workers' slots hold them all)."""
        if request.lora is None or self.max_loras is None:
            return True
        running = {r.lora for b in self.batches for r in b if r.lora is not None}
        return request.lora in running or len(running) < self.max_loras

    def _blocks_fit(self, request: Request) -> bool:
        budget = self.budget
        if budget is None:
            return True
        verifier, drafter = self._used()
        blocks = budget.blocks(request)
        return self._within_pools(verifier + blocks - self._reusable(request), drafter + blocks)

    def _reusable(self, request: Request) -> int:
        """Leading full blocks of the request's tokens that running requests hold in the verifier's cache."""
        if not (self.budget.shares_prefixes and request.params.prompt_logprobs is None):
            return 0  # a request asking for prompt logprobs computes its whole prompt
        if request.prefix_keys is None:
            request.prefix_keys = chain_keys(request.token_ids, self.budget.block_size, request.lora)
        count = 0
        while count < len(request.prefix_keys) and self._shared[request.prefix_keys[count]]:
            count += 1
        return count

    def note_written(self, request: Request, num_tokens: int) -> None:
        """A planned step writes the request's first `num_tokens` tokens to the verifier, which indexes their full
        blocks when the step ends: from the next step on, they are shared with any request that starts with them."""
        if request.prefix_keys is None or request.status is not RequestStatus.RUNNING:
            return
        written = min(num_tokens // self.budget.block_size, len(request.prefix_keys))
        if written > request.shared_blocks:
            self._shared.update(request.prefix_keys[request.shared_blocks : written])
            request.shared_blocks = written

    def _unshare(self, request: Request) -> None:
        for key in (request.prefix_keys or [])[: request.shared_blocks]:
            self._shared[key] -= 1
            if not self._shared[key]:
                del self._shared[key]
        request.shared_blocks = 0

    def remove_finished(self) -> list[Request]:
        """Take finished (or aborted) requests out of their batch and return them."""
        done = []
        for batch in self.batches:
            done.extend(r for r in batch if r.finished)
            batch[:] = [r for r in batch if not r.finished]
        for request in done:
            self._unshare(request)
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
        request.drafter_tokens = 0  # a worker admits it afresh
        if self.budget is not None and self.budget.shares_prefixes:
            request.shared_blocks = self._reusable(request)
            if request.shared_blocks:
                self._shared.update(request.prefix_keys[: request.shared_blocks])
        self.batches[index].append(request)
        return request
