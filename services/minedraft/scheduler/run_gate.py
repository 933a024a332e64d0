"""Which requests may run in the group's world now: the step loop asks as it admits and re-admits them."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from minedraft.engine.adaptive import seeded_sampling
from minedraft.engine.engine import LLMEngine
from minedraft.engine.quarantine import Quarantine
from minedraft.engine.request import Request

log = logging.getLogger("minedraft.scheduler")


class RunGate:
    """Keeps two kinds of request out of the world (the engine holds them meanwhile):

    - those a search for a poison request keeps out (engine/quarantine.py);
    - a seeded sampled request while the group decodes target-only, for at most `seeded_wait_s` of it: its text
      depends on where its windows fall, and a stretch decoded without windows would give another sample than
      a run with its drafter (docs/services.md).
    """

    def __init__(self, engine: LLMEngine, seeded_wait_s: float) -> None:
        self.engine = engine
        self.seeded_wait_s = seeded_wait_s
        self.quarantine = Quarantine()
        # Since when the group decodes target-only although it has a speculative config (None: it drafts).
        self.target_only_since = None if engine.speculating or engine.config.speculative_config is None else (
            time.monotonic())  # fmt: skip

    def may_run(self, request_id: str) -> bool:
        """Whether a request may run in the world now."""
        if not self.quarantine.may_run(request_id):
            return False
        request = self.engine.requests.get(request_id)
        return (self.target_only_since is None or request is None or not seeded_sampling(request)
                or time.monotonic() - self.target_only_since >= self.seeded_wait_s)  # fmt: skip

    def world_formed(self, has_drafter: bool) -> None:
        if has_drafter or self.engine.config.speculative_config is None:
            self.target_only_since = None
        elif self.target_only_since is None:  # the outage goes on across re-formations without a drafter
            self.target_only_since = time.monotonic()

    def release_waiting_seeds(self) -> None:
        """Past the wait, the seeded requests held for a drafter decode target-only."""
        if (self.target_only_since is not None and self.engine.held
                and time.monotonic() - self.target_only_since >= self.seeded_wait_s):  # fmt: skip
            self.engine.release_held(self.may_run)

    def ran(self, touched: Iterable[Request]) -> None:
        """A step completed with these requests: during a search, some may be cleared and held ones let in."""
        if self.quarantine.searching and self.quarantine.ran(r.request_id for r in touched):
            self.engine.release_held(self.may_run)

    def left(self, request_id: str) -> None:
        """A request left the engine: a search for a poison request may now let held requests in."""
        if self.quarantine.forget(request_id):
            self.engine.release_held(self.may_run)

    def blame(self) -> str | None:
        """A step that the running requests took part in failed with an error: the request to convict, if any."""
        convicted = self.quarantine.failed(self.engine.running_ids())
        if self.quarantine.searching:
            log.warning("looking for a request that fails every step: %d suspects, %d under test",
                        len(self.quarantine.suspects), len(self.quarantine.testing))  # fmt: skip
        return convicted
