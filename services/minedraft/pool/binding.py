"""A group's side of a drafter pool: which member it drafts with.

A group binds to one member at a time and keeps it while it serves (sticky: its requests' draft KV and prefix
cache stay warm there). When the member dies or drains, or the group first binds, it takes the serving member
with the most room: the fewest groups for its capacity, then the shortest queue. The members are HOST:PORT
specs; a host name that resolves to several addresses (a Kubernetes headless Service) is one member per
address, resolved again at each binding, so members that come and go are found.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from minedraft.api import generate_pb2, worker_pb2

log = logging.getLogger("minedraft.pool")


@dataclass
class MemberState:
    address: str
    serving: bool = False
    groups: int = 0
    capacity: int = 0
    queue: int = 0

    @property
    def has_room(self) -> bool:
        return self.serving and self.groups < self.capacity


class DrafterPool:
    def __init__(self, specs: list[str], make_client: Callable[[str], Any]) -> None:
        """`make_client(address)`: a WorkerClient (scheduler/remote_executor.py) of the member there."""
        if not specs:
            raise ValueError("a drafter pool needs at least one member address (HOST:PORT)")
        for spec in specs:
            _split(spec)
        self.specs = specs
        self._make_client = make_client
        self._clients: dict[str, Any] = {}
        self.bound: Any = None
        self.members: dict[str, MemberState] = {}  # as last looked at (at each binding, and about every second)
        self.rebinds = 0
        self.queue = 0  # the bound member's queue, as of this group's last step

    def addresses(self) -> list[str]:
        """Every member's address now (each spec resolved; one that does not resolve is skipped)."""
        found: list[str] = []
        for spec in self.specs:
            found += [a for a in _resolve(spec) if a not in found]
        return found

    def client(self, address: str):
        if address not in self._clients:
            self._clients[address] = self._make_client(address)
        return self._clients[address]

    def look(self) -> dict[str, MemberState]:
        """Every member as it answers now (blocks: a health check and an info call each)."""
        return {a: self._state(a) for a in self.addresses()}

    def wants_binding(self, drafting: bool) -> bool:
        """Whether binding again would change something: while the group drafts, its member stopped serving
        (it drains or died) and another has room; while it does not, some member has room."""
        self.members = members = self.look()
        bound = members.get(self.bound.address) if self.bound is not None else None
        if drafting:
            return not (bound and bound.serving) and any(m.has_room for m in members.values())
        return any(m.has_room for m in members.values())

    def bind(self):
        """The member to draft with now: the bound one while it serves, else the serving member with the most
        room (None: none has room, the group decodes target-only). Returns its WorkerClient."""
        self.members = self.look()
        bound = self.bound.address if self.bound is not None else None
        if bound in self.members and self.members[bound].serving:
            return self.bound
        free = [m for m in self.members.values() if m.has_room]
        if not free:
            return None
        best = min(free, key=lambda m: (m.groups / m.capacity, m.queue, m.address))
        if bound is not None and best.address != bound:
            self.rebinds += 1
            log.info("binding to the pool drafter at %s (was %s)", best.address, bound)
        self.bound = self.client(best.address)
        return self.bound

    def candidate(self):
        """The member a world without a drafter keeps in view: the bound one, else the first address."""
        if self.bound is not None:
            return self.bound
        addresses = self.addresses() or self.specs
        return self.client(addresses[0])

    def _state(self, address: str) -> MemberState:
        client = self.client(address)
        if not client.serving():
            return MemberState(address)
        try:
            info = client.stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=2.0)
        except grpc.RpcError:
            return MemberState(address)
        return MemberState(address, True, info.pool_groups, info.pool_capacity, info.pool_queue)

    def info(self, bound: bool) -> generate_pb2.DrafterPoolInfo:
        """For GetServerInfo: the member bound (when the group drafts with it) and every member as last seen."""
        members = [generate_pb2.DrafterPoolMember(address=m.address, serving=m.serving, groups=m.groups,
                                                  capacity=m.capacity, queue=m.queue)
                   for m in self.members.values()]  # fmt: skip
        return generate_pb2.DrafterPoolInfo(bound=self.bound.address if bound and self.bound else "",
                                            members=members, rebinds=self.rebinds, queue=self.queue)  # fmt: skip

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


def _resolve(spec: str) -> list[str]:
    """HOST:PORT as one address per IPv4 address of HOST when it has several (a headless Service), else as given."""
    host, port = _split(spec)
    try:
        infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    addresses = sorted({info[4][0] for info in infos})
    return [f"{a}:{port}" for a in addresses] if len(addresses) > 1 else [spec]


def _split(spec: str) -> tuple[str, str]:
    host, _, port = spec.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--drafter-pool: {spec!r} is not HOST:PORT")
    return host, port
