"""Routing policies: which serving engine group a request (or a migrated request's rest) is placed on.

- `least-work`: the fewest requests in the group, then the fewest tokens owed (`pool.least_work`).
- `prefix`: the group that holds the longest cached prefix of the request's tokens. The gateway computes
  the block-hash chain the groups' schedulers use (`chain_keys`, with the groups' KV block size) and learns
  which group holds which blocks from where it placed them. Nothing is shared between gateway replicas:
  each learns from its own traffic, so replicas agree approximately (a prefix they both sent lives on
  whichever group each placed it first), and a group's evictions are not seen (the table forgets least
  recently placed blocks first). A request with an `x-session-id` goes to its session's group instead
  (rendezvous hashing: every replica picks the same group, and a group leaving moves only its sessions).
  Either way, a chosen group holding `IMBALANCE` more requests than the least loaded one loses the request
  to that one.
- `predicted`: the earliest predicted completion: the wait for a free slot, prefill of the prompt's
  uncached tokens and this request's tokens, at the speeds each group measures (`pool.Measured`, scaled to
  the batch the request would join); the cache counts as the prefill it saves, so affinity holds only while
  it saves more than the wait costs. The session header is not used: a session's cached history is.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from minedraft.engine.batch_manager import chain_keys
from minedraft.gateway.pool import Backend, least_work

POLICIES = ("least-work", "prefix", "predicted")
SESSION_HEADER = "x-session-id"
IMBALANCE = 4  # requests more than the least loaded group, beyond which affinity gives way
_TABLE_BLOCKS = 1 << 18  # block keys remembered (~40 MB at most), least recently placed forgotten first
_KV_FULL = 0.95  # KV use beyond which a group admits nothing new until a request ends
_TIE = 0.05  # predictions within 5% of the best are equal: the most cached, then the least work, wins
# Until a group has finished a request there is no measured speed: these stand in (a small GPU's).
_DEFAULT_TOKEN_S = 0.02
_DEFAULT_PREFILL_TOKEN_S = 0.0005


@dataclass(frozen=True)
class Placement:
    """What a policy knows of the request it places: its tokens so far (prompt + output already streamed, on
    a migration), the tokens it may still produce, its session and its blocks' keys."""

    token_ids: list[int]
    max_tokens: int
    session: str | None = None
    keys: tuple[bytes, ...] = ()


class LeastWork:
    """The group with the fewest requests, then the fewest tokens owed."""

    block_size: int = 0  # the groups' KV block size; 0 until a group told it
    max_num_seqs: int = 0  # requests a group runs at once

    def placement(self, token_ids: list[int], max_tokens: int, session: str | None, lora: str | None = None
                  ) -> Placement:  # fmt: skip
        """`lora`: the request's LoRA adapter, whose cached blocks are its own on every group."""
        return Placement(token_ids, max_tokens, session)

    def choose(self, backends: list[Backend], request: Placement) -> Backend:
        return least_work(backends)

    def placed(self, backend: Backend, request: Placement) -> None:
        """The request was placed on `backend`."""


class PrefixAffinity(LeastWork):
    """The group holding the longest cached prefix, or the session's group, unless it is overloaded."""

    def __init__(self) -> None:
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()  # block key -> groups it was placed on

    def placement(self, token_ids: list[int], max_tokens: int, session: str | None, lora: str | None = None
                  ) -> Placement:  # fmt: skip
        keys = tuple(chain_keys(token_ids, self.block_size, lora)) if self.block_size and not session else ()
        return Placement(token_ids, max_tokens, session, keys)

    def choose(self, backends: list[Backend], request: Placement) -> Backend:
        lightest = least_work(backends)
        if request.session:
            chosen = max(backends, key=lambda b: _rendezvous(request.session, b.address))
        else:
            cached = self.cached_blocks(backends, request)
            chosen = max(backends, key=lambda b: (cached[b.address], -b.load[0], -b.load[1]))
            if not cached[chosen.address]:
                return lightest
        return chosen if chosen.load[0] - lightest.load[0] <= IMBALANCE else lightest

    def cached_blocks(self, backends: list[Backend], request: Placement) -> dict[str, int]:
        """Per group: how many of the request's leading blocks it was sent (so may hold in its cache)."""
        counts = dict.fromkeys((b.address for b in backends), 0)
        live = set(counts)
        for key in request.keys:
            live &= self._holders.get(key, set())
            if not live:
                break
            for address in live:
                counts[address] += 1
        return counts

    def placed(self, backend: Backend, request: Placement) -> None:
        for key in request.keys:
            self._holders.setdefault(key, set()).add(backend.address)
            self._holders.move_to_end(key)
        while len(self._holders) > _TABLE_BLOCKS:
            self._holders.popitem(last=False)


class Predicted(PrefixAffinity):
    """The group with the earliest predicted completion of this request."""

    def placement(self, token_ids: list[int], max_tokens: int, session: str | None, lora: str | None = None
                  ) -> Placement:  # fmt: skip
        return super().placement(token_ids, max_tokens, None, lora)  # the session weighs as its cached prefix does

    def choose(self, backends: list[Backend], request: Placement) -> Backend:
        cached = self.cached_blocks(backends, request)
        token_s, prefill_s = _known_speeds(backends)
        times = {b.address: self.predict(b, request, cached[b.address] * self.block_size, token_s, prefill_s)
                 for b in backends}  # fmt: skip
        best = min(times.values())
        near = [b for b in backends if times[b.address] <= best * (1 + _TIE)]
        return min(near, key=lambda b: (-cached[b.address], b.load))  # a near tie: the cache, then the least work

    def predict(self, backend: Backend, request: Placement, cached_tokens: int, token_s: float,
                prefill_s: float) -> float:  # fmt: skip
        """Seconds until the request would finish on `backend`: the wait for a free slot, then prefill of its
        uncached tokens and its tokens at the group's measured speed (`token_s`, `prefill_s` where unknown)."""
        measured = backend.measured
        queued, owed = backend.load
        slots = max(self.max_num_seqs, 1)
        # A step carries every running request: past the batch it was measured at, assume each request slows
        # in proportion (throughput-bound; a GPU below its batch knee slows less, so this errs toward spreading).
        token_s = (measured.token_seconds or token_s) * max(1.0, min(queued + 1, slots) / measured.running)
        ahead = queued - slots + 1  # requests that must end before this one runs
        if measured.kv_usage >= _KV_FULL:
            ahead = max(ahead, 1)
        mean_tokens = owed / backend.requests if backend.requests else request.max_tokens
        wait = max(ahead, 0) * mean_tokens * token_s / slots
        prefill = max(len(request.token_ids) - cached_tokens, 1) * (measured.prefill_token_seconds or prefill_s)
        return wait + prefill + request.max_tokens * token_s


def _known_speeds(backends: list[Backend]) -> tuple[float, float]:
    """What stands in for a group's unmeasured speeds: the mean of the others', else the defaults."""
    token = [b.measured.token_seconds for b in backends if b.measured.token_seconds]
    prefill = [b.measured.prefill_token_seconds for b in backends if b.measured.prefill_token_seconds]
    return (sum(token) / len(token) if token else _DEFAULT_TOKEN_S,
            sum(prefill) / len(prefill) if prefill else _DEFAULT_PREFILL_TOKEN_S)  # fmt: skip


def _rendezvous(session: str, address: str) -> bytes:
    return hashlib.sha256(f"{session}\0{address}".encode()).digest()


def make_policy(name: str) -> LeastWork:
    policies = {"least-work": LeastWork, "prefix": PrefixAffinity, "predicted": Predicted}
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
    return policies[name]()
