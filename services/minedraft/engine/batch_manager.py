"""Waiting queue and running batches (two of them in MineDraft mode)."""

from __future__ import annotations

from collections import deque

from minedraft.engine.request import Request, RequestStatus


class BatchManager:
    """Holds the waiting queue and up to two running batches of at most `max_num_seqs` requests each."""

    def __init__(self, num_batches: int, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
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
        while self.waiting and len(batch) < self.max_num_seqs:
            admitted.append(self._start(self.waiting.popleft(), index))
        return admitted

    def admit_balanced(self) -> list[Request]:
        """Before decoding starts: each waiting request goes to the smaller batch."""
        admitted = []
        while self.waiting:
            index = min(range(len(self.batches)), key=lambda i: len(self.batches[i]))
            if len(self.batches[index]) >= self.max_num_seqs:
                break
            admitted.append(self._start(self.waiting.popleft(), index))
        return admitted

    def remove_finished(self) -> list[Request]:
        """Take finished (or aborted) requests out of their batch and return them."""
        done = []
        for batch in self.batches:
            done.extend(r for r in batch if r.finished)
            batch[:] = [r for r in batch if not r.finished]
        return done

    def abort_waiting(self, request_id: str) -> Request | None:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                request.abort()
                return request
        return None

    def _start(self, request: Request, index: int) -> Request:
        request.status = RequestStatus.RUNNING
        request.batch = index
        self.batches[index].append(request)
        return request
