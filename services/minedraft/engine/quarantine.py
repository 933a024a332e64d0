"""Finding a poison request: one that makes every step it takes part in fail.

A failed step re-forms the world and re-admits every request, which is right when a worker died or
hung. When one request makes the workers raise, every new world fails again as soon as it runs that
request, and re-forming alone would loop forever. The quarantine finds such a request without knowing
the cause, under one assumption: a poison request fails any step it is in, whatever else is there.

- A counted failure (the workers answered with an error; a dead or hung worker does not count) whose
  world shares requests with the previous counted failure starts a search: the shared requests are the
  suspects. Every other request in those worlds is cleared (it was absent from one of the two).
- During a search the world holds the suspects under test and cleared requests only; the other
  suspects and every newcomer wait outside it (held).
- A tested half whose requests each complete a step is cleared; the poison is then among the rest.
  A half that fails again is split again. A suspect that fails as the only one under test is convicted:
  the engine fails it with an error and never re-admits it.

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
    cleared: set[str] = field(default_factory=set)  # may stay in the world during this search

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
                self._search(common, cleared=set(world) - set(common))
            return None
        failing = [r for r in self.suspects if r in self.testing and r in world]
        if not failing:  # the tested ones were not there: the assumption does not hold, start over
            self._end()
            self.last_failure = set(world)
            return None
        if len(failing) == 1:
            self._end()
            return failing[0]
        self.cleared |= set(self.suspects) - set(failing)  # one poison: it is in the half that failed
        self._search(failing)
        return None

    def ran(self, request_ids: Iterable[str]) -> bool:
        """These requests completed a step (or left the engine). Returns True if requests held outside the
        world may now run (the caller admits those for which `may_run` became true)."""
        done = self.testing.intersection(request_ids)
        if not done:
            return False
        self.testing -= done
        self.cleared |= done
        self.suspects = [r for r in self.suspects if r not in done]
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
        self.cleared.discard(request_id)
        if request_id in self.testing:
            return self.ran([request_id])
        if request_id in self.suspects:
            self.suspects.remove(request_id)
            if not self.suspects:
                self._end()
                return True
        return False

    def _search(self, suspects: list[str], cleared: set[str] | None = None) -> None:
        self.suspects = suspects
        if cleared is not None:
            self.cleared = cleared
        self._test_half()

    def _test_half(self) -> None:
        self.testing = set(self.suspects[: max(1, len(self.suspects) // 2)])

    def _end(self) -> None:
        self.suspects, self.testing, self.cleared, self.last_failure = [], set(), set(), set()
