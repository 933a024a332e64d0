"""The step-end hand-over between a drafter of a pool and its group's verifier rank 0, over gRPC.

A pool drafter is in no group's torch.distributed world, so the two ends send each other `Exchange` calls
instead: the verifier its results, the drafter its windows (token ids and a sparse q, small enough to cross
nodes). Each end keeps an `Inbox` of what it was sent; both sides take the order from the same step plan,
and the messages of one direction arrive in the order they were sent (each call returns before the next), so
each receive takes the oldest message and checks that it is for the expected requests.

A receive that waits asks now and then whether the peer still answers: a peer that died fails the step at
once (as a broken gloo connection does), instead of at the world's timeout.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.api import worker_pb2, worker_pb2_grpc
from minedraft.engine.plans import Drafts, Verified
from minedraft.service.grpc_server import grpc_options
from minedraft.wire import drafts_to_exchange, results_to_exchange, verified_from_proto

_PEER_CHECK_S = 1.0  # how often a waiting receive asks whether the peer still answers


class PeerGone(ConnectionError):
    """The other end of the hand-over died, or this end left the world while waiting."""


class Inbox:
    """The exchange messages of one world (epoch), in arrival order. A message of another epoch is dropped:
    it belongs to a world that is gone."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._messages: deque[worker_pb2.ExchangeMessage] = deque()
        self._epoch: int | None = None

    def open(self, epoch: int) -> None:
        with self._ready:
            self._epoch = epoch
            self._messages.clear()
            self._ready.notify_all()

    def close(self) -> None:
        """Leave the world: a receive waiting here gives up (PeerGone)."""
        with self._ready:
            self._epoch = None
            self._messages.clear()
            self._ready.notify_all()

    def put(self, message: worker_pb2.ExchangeMessage) -> bool:
        with self._ready:
            if message.epoch != self._epoch:
                return False
            self._messages.append(message)
            self._ready.notify_all()
            return True

    def take(self, epoch: int, timeout_s: float, peer_alive) -> worker_pb2.ExchangeMessage:
        """The oldest message of `epoch`; waits up to `timeout_s`, asking `peer_alive()` every second."""
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + _PEER_CHECK_S
        while True:
            with self._ready:
                if self._epoch != epoch:
                    raise PeerGone(f"left world {epoch} while waiting for its hand-over")
                if self._messages:
                    return self._messages.popleft()
                self._ready.wait(timeout=min(_PEER_CHECK_S, max(0.0, deadline - time.monotonic())))
                if self._messages or self._epoch != epoch:
                    continue
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"no hand-over came within {timeout_s:.0f}s")
            if now >= next_check:
                next_check = now + _PEER_CHECK_S
                if not peer_alive():
                    raise PeerGone("the peer stopped answering while this end waited for its hand-over")


class Peer:
    """The other end's Worker service: where this end sends its half of the hand-over."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.insecure_channel(address, options=grpc_options())
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def send(self, message: worker_pb2.ExchangeMessage, timeout_s: float) -> None:
        try:
            self._stub.Exchange(message, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise PeerGone(f"the hand-over to {self.address} failed: {exc.code().name}: {exc.details()}") from exc

    def alive(self) -> bool:
        """Whether it answers at all (a draining peer still finishes its steps)."""
        try:
            self._health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        except grpc.RpcError:
            return False
        return True

    def close(self) -> None:
        self._channel.close()


class PoolLink:
    """One group's hand-over in one world: the verifier sends results and receives windows, the pool drafter
    the other way round. Request ids travel with each message and are checked against the plan's."""

    def __init__(self, peer: Peer, inbox: Inbox, epoch: int, support_size: int, timeout_s: float) -> None:
        self.peer, self.inbox, self.epoch = peer, inbox, epoch
        self.support_size, self.timeout_s = support_size, timeout_s

    def send_results(self, results: list[Verified]) -> None:
        self.peer.send(results_to_exchange(self.epoch, results), self.timeout_s)

    def send_drafts(self, request_ids: list[str], windows: dict[str, Drafts]) -> None:
        self.peer.send(drafts_to_exchange(self.epoch, request_ids, windows, self.support_size), self.timeout_s)

    def recv_results(self, request_ids: list[str]) -> list[Verified]:
        message = self._take("results", request_ids)
        return verified_from_proto(message.results.verified)

    def recv_drafts_message(self, request_ids: list[str]) -> worker_pb2.ExchangeMessage:
        """The windows as they came (verifier rank 0 hands the message on to its other ranks as it is)."""
        return self._take("drafts", request_ids)

    def _take(self, kind: str, request_ids: list[str]) -> worker_pb2.ExchangeMessage:
        message = self.inbox.take(self.epoch, self.timeout_s, self.peer.alive)
        if message.WhichOneof("payload") != kind or list(message.request_ids) != request_ids:
            raise ValueError(
                f"{kind}: the peer sent {message.WhichOneof('payload')} for {len(message.request_ids)} request(s), "
                f"{len(request_ids)} expected here in the plan's order"
            )
        return message

    def close(self) -> None:
        self.peer.close()
