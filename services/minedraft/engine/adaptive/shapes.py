"""What a decision is about: the shapes a step can take, the decision itself, the record of a planned step, and the
load a decision is made at."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from minedraft.engine.request import Request


class Shape(str, Enum):
    """How a step runs (docs/engine.md, "Step shapes")."""

    PLAIN = "plain"  # nothing drafted: the target decodes every running request, one token each
    SPECULATE = "sd"  # one batch: every request drafts its window, then the target verifies them all
    OVERLAP = "overlap"  # drafting beside verification: MineDraft's two batches, PEARL's continuation


@dataclass(frozen=True)
class Decision:
    shape: Shape
    windows: list[int]  # draft tokens for each of the shape's candidates (PLAIN: none)

    def request_windows(self, everyone: int) -> list[int]:
        """The window each request was given: a plain decision's is 0 for each of the `everyone` it decodes."""
        return self.windows if self.windows else [0] * everyone


@dataclass(frozen=True)
class StepChoice:
    """How a step was planned, recorded once when it is: its shape and, where adaptive speculation decided it, the
    window chosen for each request (`Decision.request_windows`). It stays with the step while the step is in
    flight and comes back on its result (`StepResult.choice`), where the controller learns from it and `Metrics`
    counts it."""

    shape: Shape = Shape.PLAIN
    windows: tuple[int, ...] | None = None  # None: no decision this step (fixed speculation, or only verifying)

    @property
    def plain(self) -> bool:
        """A decision that drafted nothing (plain decoding)."""
        return self.windows is not None and not any(self.windows)


# For each speculative shape possible now: the requests it would draft and each one's cap.
Candidates = Mapping[Shape, tuple[Sequence[Request], Sequence[int]]]


def as_it_is(shape: Shape, candidates: Candidates) -> Decision:
    """The shape with every request at its cap (k, or less where the request asks or ends sooner)."""
    return Decision(shape, [] if shape is Shape.PLAIN else list(candidates[shape][1]))


def load_kind(running: int) -> int:
    """The load a decision is made at, for the cost models and the shape factors: running requests 1, 2-4, 5-16,
    17-64, 65-256, ... (factors of four, a few kinds to learn). Each kind ends at a power of two, where a server's
    concurrency usually sits, so that a load hovering just below it as requests end and join stays one kind
    (docs/engine.md, "Adaptive speculation: step shapes and k")."""
    kind, edge = 0, 1
    while running > edge and kind < 7:
        kind, edge = kind + 1, edge * 4
    return kind


def seeded_sampling(request: Request) -> bool:
    """Whether the request samples with a seed: its text depends on its windows, which therefore stay fixed."""
    return request.params.seed is not None and request.params.temperature > 0
