"""A worker's intra-op threads on a CPU that it shares with the other worker and the services, chosen per step part.

Drafter and verifier processes on one machine (`minedraft up`, a laptop) share its cores with each other, the
scheduler and its clients. A part that runs while the other worker computes too (an overlapped step) takes its
share of the cores, since two thread pools that oversubscribe them spin against each other. A part that runs
alone takes the thread count measured fastest here for steps of its size (`ThreadCounts`), timed from its start
to the next part's: what the whole stack makes of the count, not the forward alone. On a quiet machine every
core wins at any batch; served at few requests the scheduler and the clients wake on every token, and a forward
of many small parallel regions waits at each barrier for a thread that lost its core, so fewer threads can win
(the figures: docs/engine.md, "Tuning constants"). Switching costs a few microseconds when
the count changes (torch keeps its pool)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from minedraft.engine.adaptive.trials import Trials

# DEBUG: each kind's best count as it changes, with what each count measured (`--log-level DEBUG`).
log = logging.getLogger("minedraft.engine.threads")  # the name operators filter on

# A part's cycle (its start to the next part's) counts while under _CYCLE_WITHIN x its own seconds + _CYCLE_SLACK.
_CYCLE_WITHIN = 3.0  # x its seconds: a longer cycle waited for work, not the count; docs/engine.md#tuning-constants
_CYCLE_SLACK = 0.005  # seconds a cycle may exceed that by, however short its part; docs/engine.md#tuning-constants


class StepThreads:
    """`beside`: threads for a part that runs beside the other worker's (0: as many as alone). A part that runs
    alone uses the count `ThreadCounts` finds fastest for its kind of step, timed from its start to the start of
    the next part: a count that speeds up this process's forward but slows the scheduler and the clients (which
    share the cores, and send the next plan) shows as a longer cycle, not a shorter forward."""

    def __init__(self, device: str, beside: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.alone = torch.get_num_threads()
        self._clock = clock
        self.beside = min(beside, self.alone) if device == "cpu" and beside > 0 else self.alone
        self._current = self.alone
        self._counts = ThreadCounts(self.alone) if device == "cpu" and self.alone > 1 else None
        # The part running alone: its kind of step, thread count and start; and its own seconds (`done`).
        self._measuring: tuple[StepKind, int, float] | None = None
        self._part_seconds: float | None = None
        # The last part runs on a count being tried, not the best known for its kind: its step is slower or
        # faster for the count, which the engine must not read as what the step's shape costs.
        self.trying = False

    def use(self, together: bool, requests: int = 1, prefill: bool = False, part: str = "", tokens: int = 0) -> None:
        """Set this thread's intra-op threads for a part of `requests` (that reads prompts, if `prefill`) that
        runs beside the other's (`together`) or alone. `part` names what the part does where one process runs
        parts of different costs at the same size (a verifier that drafts too: drafting, verifying windows, plain
        decoding), and `tokens` how much of it (the tokens a verification feeds, the tokens drafted), where known
        before it runs, so that each kind is timed apart: counts compared on steps of different windows (adaptive
        k changes them every step) were compared on their windows, not on their threads."""
        now = self._clock()
        self._finish_cycle(now)
        count, self.trying = self.beside, False
        if not together:
            count = self.alone
            if self._counts is not None:
                kind = StepKind(part, _bucket(requests), _bucket(tokens), prefill)
                count = self._counts.pick(kind)
                self._measuring = (kind, count, now)
                self.trying = self._counts.trying
        if count != self._current:
            torch.set_num_threads(count)
            self._current = count

    def rest(self) -> None:
        """The process is idle: give it back the threads it had (an in-process engine between its calls, so that
        the caller's own torch code, or a second engine built then, finds them as they were)."""
        self._measuring, self._part_seconds = None, None
        if self._current != self.alone:
            torch.set_num_threads(self.alone)
            self._current = self.alone

    def done(self, seconds: float) -> None:
        """The part set up by the last `use` computed for `seconds`."""
        self._part_seconds = seconds

    def _finish_cycle(self, now: float) -> None:
        """Time the last part alone up to now, unless the process sat idle in between (no next step for a while:
        then the gap is not the part's)."""
        if self._measuring is not None and self._part_seconds is not None and self._counts is not None:
            kind, count, start = self._measuring
            if now - start <= _CYCLE_WITHIN * self._part_seconds + _CYCLE_SLACK:
                self._counts.add(kind, count, now - start)
        self._measuring, self._part_seconds = None, None


def _bucket(n: int) -> int:
    """Sizes by powers of two."""
    return min(n, 1 << 12).bit_length()


class StepKind(NamedTuple):
    """A kind of part that runs alone: what it does (`StepThreads.use`), its requests and tokens by powers of two,
    whether it reads prompts."""

    part: str
    requests: int
    tokens: int
    prefill: bool

    def covers(self, other: StepKind) -> bool:
        """Whether this kind runs the forward `other` runs, for as many requests, on more tokens (a plain step
        runs a verification's forward on one token a request)."""
        return self.forward == other.forward and self.tokens > other.tokens

    @property
    def forward(self) -> tuple[str, int, bool]:
        return "verify" if self.part == "plain" else self.part, self.requests, self.prefill


class ThreadCounts:
    """Per kind of step (its size in requests and tokens, by powers of two, and whether it prefills), the intra-op
    thread count whose steps took the least time here (`Trials`, a step's cycle its cost). A count is tried for a run of
    steps and only the steps after the first few of a run count: what a count does to the other processes on the
    cores (a scheduler that falls behind, say) shows only after a few steps, so one step alone would carry its
    predecessors' effect. A run's settled steps count as their median, each, so that one cycle that waited for a
    client does not decide a trial.

    A kind is tried on fewer threads than all only while no kind it covers (the same forward for as many requests,
    on fewer tokens) measured every thread fastest: more tokens per parallel region only widen that lead, and the
    tries of a rare large step cost the most. Not across numbers of requests: a load measured while it ramped up on
    a quiet machine says nothing of the same load beside a busy neighbour.

    A step that reads prompts is never tried on fewer threads: it is hundreds of tokens a parallel region, and a
    kind seen once a wave of new requests (the figures behind each rule: docs/engine.md, "Tuning constants")."""

    _RUN = 6  # steps a count runs when tried or probed; docs/engine.md#tuning-constants
    _SETTLE = 2  # first steps of a run (they carry the steps before), not counted; docs/engine.md#tuning-constants
    _PROBE_EVERY = 256  # steps of a kind from a probe of another count to the next; docs/engine.md#tuning-constants
    _DECAY = 0.8  # per sample: a probe's steps outweigh what a count measured long ago; docs/engine.md#tuning-constants

    def __init__(self, most: int) -> None:
        self.most = most
        self.candidates = sorted({1, max(1, most // 2), most})
        self._trials = Trials(self._RUN, self._PROBE_EVERY, self._DECAY)
        self._covered: dict[StepKind, bool] = {}  # per kind, whether it covers a kind where every thread won
        # Per kind: the last count picked and how many picks of the kind in a row it has had (kinds interleave:
        # a verifier that drafts too runs draft and verify parts by turns, each on its own count).
        self._runs: dict[StepKind, tuple[int, int]] = {}
        self._settled: dict[tuple[StepKind, int], list[float]] = {}  # per kind and count: cycles not counted yet
        self._steady: set[StepKind] = set()  # kinds picked since the last sample (see `pick`)
        self.trying = False

    def pick(self, kind: StepKind) -> int:
        """The count for the next part of `kind`; `trying` says whether it is a try or a probe, not the best known.
        Between the samples that can change a choice (one every few steps), a kind settled on its count keeps it
        without weighing the counts again (the weighing is a measurable share of a short step)."""
        last, streak = self._runs.get(kind, (0, 0))
        if kind in self._steady and self._trials.keep(kind, last):
            self._runs[kind], self.trying = (last, streak + 1), False
            return last
        candidates = self._candidates(kind)
        count = int(self._trials.pick(kind, candidates))
        self._runs[kind] = (count, streak + 1 if count == last else 1)
        # A try or a probe: where there is a choice, a count not measured yet or dearer than the margin allows
        self.trying = len(candidates) > 1 and (self._trials.cost(kind, count) == float("inf")
                                                or self._trials.choice(kind, candidates, count) != count)
        self._steady.add(kind)
        return count

    def best(self, kind: StepKind) -> int:
        return int(self._trials.best(kind, self._candidates(kind)))

    def _candidates(self, kind: StepKind) -> list[int]:
        """The counts worth trying for `kind`: every thread alone where it reads prompts, or where it covers a kind
        that measured every thread fastest (asked again once a count's cost changes)."""
        if kind.prefill:
            return [self.most]
        covered = self._covered.get(kind)
        if covered is None:
            every_thread_won = [other for other, measured in self._trials.costs().items() if len(measured) ==
                                len(self.candidates) and min(measured, key=measured.get) == self.most]
            covered = self._covered[kind] = any(kind.covers(other) for other in every_thread_won)
        return [self.most] if covered else self.candidates

    def add(self, kind: StepKind, count: int, seconds: float) -> None:
        """The step just picked for `kind` took `seconds` (counted once its run has settled, by runs' settled
        steps: their median, as many times as they are)."""
        last, streak = self._runs.get(kind, (0, 0))
        if last != count or streak <= self._SETTLE:
            self._settled.pop((kind, count), None)
            return
        cycles = self._settled.setdefault((kind, count), [])
        cycles.append(seconds)
        if len(cycles) == self._RUN - self._SETTLE:
            before = self.best(kind) if log.isEnabledFor(logging.DEBUG) else None
            self._trials.add(kind, count, statistics.median(cycles) * len(cycles), len(cycles))
            self._covered.clear()
            self._steady.clear()
            cycles.clear()
            if before is not None and self.best(kind) != before:
                measured = {n: round(cost * 1e3, 3) for n, cost in self._trials.costs()[kind].items()}
                log.debug("threads for %s: %d (ms a step by count: %s)", kind, self.best(kind), measured)
