"""Finding a poison request: one that makes every step it takes part in fail.

A failed step re-forms the world and re-admits every request, which is right when a worker died or
hung. When one request makes the workers raise, every new world fails again as soon as it runs that
request, and re-forming alone would loop forever. The quarantine finds such a request without knowing
the cause, under one assumption: a poison request fails any step it is in, whatever else is there.

- A counted failure (the workers answered with an error; a dead or hung worker does not count) whose
  world shares requests with the previous counted failure starts a search: the shared requests are the
  suspects.
- During a search the world holds the suspects under test and requests proven innocent in this search
  (they completed a step) only; every other request, newcomers included, waits outside it (held).
- A tested half whose requests each complete a step is cleared; the poison is then among the rest.
  A half that fails again is split again (the suspects left untested wait outside until the search
  ends). A suspect that fails as the only one under test is convicted: the engine fails it with an error
  and never re-admits it. A second poison request, if any, is found by the next search.

One poison request among n costs about log2(n) + 2 re-formations; innocent requests keep every token
they have (re-admission is lossless) and only wait.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Quarantine:
    last_failure: set[str] = field(default_factory=set)  # the world at the previous counted failure
    suspects: list[str] = field(default_factory=list)  # not yet cleared, in arrival order; empty: no search
    testing: set[str] = field(default_factory=set)  # the suspects in the world now
    cleared: set[str] = field(default_factory=set)  # completed a step during this search: may stay in the world

    @property
    def searching(self) -> bool:
        return bool(self.suspects)

    def may_run(self, request_id: str) -> bool:
        """Whether this request may be in the world now (outside a search: every request)."""
        return not self.searching or request_id in self.testing or request_id in self.cleared

    def failed(self, world: Iterable[str]) -> str | None:
        """A step failed with `world` in it (in arrival order). Returns the request to convict, if any."""
        world = list(world)
        if not self.searching:
            common = [r for r in world if r in self.last_failure]
            self.last_failure = set(world)
            if common:
                self.suspects = common
                self._test_half()
            return None
        failing = [r for r in self.suspects if r in self.testing and r in world]
        if len(failing) == 1:
            self._end()
            return failing[0]
        self._end()
        if failing:  # the poison is in the half that failed: split it again
            self.suspects = failing
            self._test_half()
        else:  # the tested ones were not there: the assumption does not hold, start over
            self.last_failure = set(world)
        return None

    def ran(self, request_ids: Iterable[str]) -> bool:
        """These requests completed a step (or left the engine). Returns True if the requests allowed in the
        world changed (the caller admits the held ones for which `may_run` became true)."""
        ran = set(request_ids)
        if not self.searching or not ran & self.testing:
            self.cleared |= ran if self.searching else set()
            return False
        self.cleared |= ran
        self.testing -= ran
        self.suspects = [r for r in self.suspects if r not in ran]
        if self.testing:
            return False
        if self.suspects:  # the poison is among the untested ones: test half of them (a last one alone)
            self._test_half()
        else:  # every suspect ran: nothing to convict (the failures had another cause)
            self._end()
        return True

    def forget(self, request_id: str) -> bool:
        """The request left the engine (finished, aborted, convicted); as `ran`."""
        self.last_failure.discard(request_id)
        if request_id in self.testing:
            return self.ran([request_id])
        self.cleared.discard(request_id)
        if request_id in self.suspects:
            self.suspects.remove(request_id)
            if not self.suspects:
                self._end()
                return True
        return False

    def _test_half(self) -> None:
        self.testing = set(self.suspects[: max(1, len(self.suspects) // 2)])

    def _end(self) -> None:
        self.suspects, self.testing, self.cleared, self.last_failure = [], set(), set(), set()
