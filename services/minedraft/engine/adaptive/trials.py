"""Trials: per kind of situation, the candidate measured cheapest here, tried in runs and probed now and then
(the step shapes of `controller.py`, the thread counts of `threads.py`)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from minedraft.engine.adaptive.fits import Decayed


class Trials:
    """Per kind of situation, the candidate whose runs cost the least per unit of work here (seconds per token,
    say), measured, not predicted. Each candidate a kind allows is first tried for a run of `run` picks; then the
    cheapest runs, and now and then another candidate runs again (a probe), so that a change (a neighbour that
    comes or goes, a load the costs differ at) is noticed. With `first_runs` above 1 each candidate is tried in
    that many runs before one is settled on, the one tried least next, so that the tries interleave (A B A B): a
    single try measured during a burst of other work (a neighbour, the serving processes' own) otherwise decided
    the choice until the first probe. The caller adds only the samples of a run that has
    settled (the first steps after a change carry the change's own cost). `decay` per sample.

    A probe is judged by what its own runs measured, against the candidate in use: a candidate's estimate from
    before holds what it measured at another time (a burst of other work while it ran stayed in it while another
    ran, and with the probes' samples blended in, kept the choice on the other through probe after probe). A
    probe that wins switches only once it wins a second time, after a run of the candidate in use (A B A B): a
    probe's few samples are as noisy as the steps they time. Then what its runs measured replaces the
    candidate's estimate; a probe that loses is blended in.

    Changing costs too (the switch itself, and every probe runs something slower): the candidate in use stays
    until another measures cheaper by more than `margin` (a fraction), and each probe that changes nothing
    doubles the picks to the next one, from `probe_every` up to `max_backoff` times it; once the candidate in use
    costs more or less than it did by `drift` (a fraction), the probes come at `probe_every` again. Where a
    candidate's measured cost is scaled by a prediction (`pick`'s `scale`), a probe runs only for candidates that
    could win: measured `reach` (a fraction) cheaper than the cheapest measured here (`_contenders`). The defaults'
    values: docs/engine.md, "Tuning constants"."""

    def __init__(self, run: int, probe_every: int, decay: float, margin: float = 0.03, max_backoff: int = 8,
                 drift: float = 0.1, first_runs: int = 1, reach: float = 0.15) -> None:
        self.run, self.probe_every, self.decay = run, probe_every, decay
        self.margin, self.max_backoff, self.drift, self.reach = margin, max_backoff, drift, reach
        self.first_runs = first_runs
        # kind -> candidate -> its decayed seconds over work; kind -> where its picks stand.
        self._cost: dict[Hashable, dict[Hashable, Decayed]] = {}
        self._state: dict[Hashable, _KindState] = {}

    def pick(self, kind: Hashable, candidates: Sequence[Hashable], scale: Mapping[Hashable, float] | None = None,
             ) -> Hashable:
        """The candidate to run now, of those allowed now (the untried in the order given). `scale`: what each
        candidate's measured cost is worth now, where the work it is measured in is not the work that counts (a
        step measured in the seconds a model predicted for it, chosen by seconds per token predicted now)."""
        state = self._state.setdefault(kind, _KindState(interval=self.probe_every, next_probe=self.probe_every))
        state.picks += 1
        if state.left and state.current in candidates:
            state.left -= 1
            return state.current
        if state.probing:  # a probe's run has ended: did it change the choice?
            state.probing = False
            won = self._probe_won(kind, state, candidates, scale)
            if won and not state.won_once:  # once: the candidate in use runs again, then this one (A B A B)
                state.won_once = True
                state.current, state.left = state.settled, self.run - 1
                return state.current
            if won:  # twice: what its runs measured is what it costs now
                self._cost[kind][state.probed] = Decayed(*state.fresh)
            state.won_once, state.probed = False, None
            state.interval = self.probe_every if won else min(2 * state.interval, self.max_backoff * self.probe_every)
            state.next_probe = state.picks + state.interval
        measured, tries = self._cost.get(kind, {}), state.tries
        untried = [c for c in candidates if c not in measured or tries.get(c, 0) < self.first_runs]
        settled = self.choice(kind, candidates, state.settled, scale)
        others = [c for c in candidates if c != settled]
        due = state.picks >= state.next_probe and bool(others)
        contenders = self._contenders(kind, others, settled, scale) if due else []
        if untried:  # the one tried least first (of those, the first in the order given)
            state.current, state.left = min(untried, key=lambda c: tries.get(c, 0)), self.run - 1
            tries[state.current] = tries.get(state.current, 0) + 1
        elif state.won_once and state.probed in candidates:  # its second probe
            state.current, state.left, state.probing = state.probed, self.run - 1, True
        elif contenders:  # a probe (of those that could win)
            state.probes += 1
            state.current, state.left, state.probing = contenders[state.probes % len(contenders)], self.run - 1, True
            state.probed, state.fresh = state.current, (0.0, 0.0)
        else:
            if due:  # a probe was due but none could win: none until the next interval
                state.next_probe = state.picks + state.interval
            state.won_once, state.probed = False, None
            state.current = state.settled = settled
            self._watch_drift(kind, state)
        return state.current

    def _contenders(self, kind: Hashable, others: list[Hashable], settled: Hashable,
                    scale: Mapping[Hashable, float] | None) -> list[Hashable]:
        """The candidates a probe could find cheaper than the settled one: with `scale` (what each candidate's
        measured cost is worth now), those that would win measured `reach` cheaper than the best measured here.
        Where the prediction alone puts a candidate out of reach, its probe only costs (docs/engine.md, "Adaptive
        speculation: step shapes and k")."""
        measured = self._cost.get(kind, {})
        if scale is None or not measured:
            return others
        best = min(self.cost(kind, c) for c in measured) * (1 - self.reach)
        to_beat = self._scaled(kind, settled, scale) * (1 - self.margin)
        return [c for c in others if best * scale[c] < to_beat]

    def _probe_won(self, kind: Hashable, state: _KindState, candidates: Sequence[Hashable],
                   scale: Mapping[Hashable, float] | None) -> bool:
        """Whether the probed candidate's runs measured it cheaper than the one in use by more than the margin."""
        seconds, work = state.fresh
        if work <= 0 or state.probed not in candidates or state.settled not in candidates:
            return False
        fresh = seconds / work * (scale[state.probed] if scale is not None else 1.0)
        return fresh < self._scaled(kind, state.settled, scale) * (1 - self.margin)

    def keep(self, kind: Hashable, candidate: Hashable) -> bool:
        """Count a pick of `candidate` without weighing the candidates again, where it is what `pick` would run
        unless the costs moved: the one settled on, no try or probe running or due. False (nothing counted)
        otherwise: then `pick`."""
        state = self._state.get(kind)
        if (state is None or state.left or state.probing or state.won_once
                or state.current != candidate or state.settled != candidate
                or state.picks + 1 >= state.next_probe):  # fmt: skip
            return False
        state.picks += 1
        return True

    def _watch_drift(self, kind: Hashable, state: _KindState) -> None:
        """Probes at their base rate again once the settled candidate's cost has moved (the machine changed)."""
        cost = self.cost(kind, state.settled)
        if state.watched != state.settled or not 0 < state.baseline < float("inf"):
            state.watched, state.baseline = state.settled, cost
        elif abs(cost / state.baseline - 1) > self.drift:
            state.interval, state.baseline = self.probe_every, cost
            state.next_probe = min(state.next_probe, state.picks + self.probe_every)

    def choice(self, kind: Hashable, candidates: Sequence[Hashable], incumbent: Hashable | None = None,
               scale: Mapping[Hashable, float] | None = None) -> Hashable:
        """The measured cheapest of `candidates`, unless `incumbent` is within the margin of it."""
        best = self.best(kind, candidates, scale)
        if incumbent in candidates and (self._scaled(kind, incumbent, scale) * (1 - self.margin)
                                        <= self._scaled(kind, best, scale)):  # fmt: skip
            return incumbent
        return best

    def best(self, kind: Hashable, candidates: Sequence[Hashable], scale: Mapping[Hashable, float] | None = None,
             ) -> Hashable:
        """The measured cheapest of `candidates` (the first, before any was measured)."""
        measured = self._cost.get(kind, {})
        return min(candidates, key=lambda c: self._scaled(kind, c, scale) if c in measured else float("inf"))

    def _scaled(self, kind: Hashable, candidate: Hashable, scale: Mapping[Hashable, float] | None) -> float:
        return self.cost(kind, candidate) * (scale[candidate] if scale is not None else 1.0)

    def cost(self, kind: Hashable, candidate: Hashable) -> float:
        sums = self._cost.get(kind, {}).get(candidate)
        return sums.per(empty=float("inf")) if sums is not None else float("inf")

    def add(self, kind: Hashable, candidate: Hashable, seconds: float, work: float) -> None:
        self._cost.setdefault(kind, {}).setdefault(candidate, Decayed()).add(seconds, work, self.decay)
        state = self._state.get(kind)
        if state is not None and state.probed == candidate:
            state.fresh = (state.fresh[0] + seconds, state.fresh[1] + work)

    def costs(self) -> dict[Hashable, dict[Hashable, float]]:
        """Per kind, each measured candidate's cost per unit of work."""
        return {kind: {c: self.cost(kind, c) for c in costs} for kind, costs in self._cost.items()}


@dataclass
class _KindState:
    interval: int  # picks from one probe to the next
    next_probe: int  # the pick the next probe starts at
    picks: int = 0
    current: Hashable = None  # the candidate running now, and the picks its run has left
    left: int = 0
    settled: Hashable = None  # the candidate chosen outside tries and probes
    probing: bool = False  # the current run is a probe
    probes: int = 0
    probed: Hashable = None  # the candidate under probe, and what its probe runs measured (seconds, work)
    fresh: tuple[float, float] = (0.0, 0.0)
    won_once: bool = False  # the probed candidate won its first probe: it runs again after a run of the settled
    tries: dict = field(default_factory=dict)  # candidate -> its first tries begun
    watched: Hashable = None  # the settled candidate whose cost is watched, and its cost when watching began
    baseline: float = 0.0
