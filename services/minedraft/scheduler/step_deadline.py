"""How long the scheduler waits for a step before it counts a worker as hung.

A worker that is stopped (SIGSTOP), deadlocked or cut off never answers, and its peer waits for it in
the step-end exchange: without a deadline the world would hang. The deadline follows the observed step
times, max(floor, factor x a high percentile of the recent steps), so that it is tight on a GPU and
still generous on a slow CPU; the floor covers the first steps (model warm-up, the first prefill),
before there is anything to observe.
"""

from __future__ import annotations

from collections import deque


class StepDeadline:
    def __init__(self, floor_s: float, factor: float = 10.0, percentile: float = 0.99, window: int = 256) -> None:
        if floor_s <= 0 or factor < 1 or not 0 < percentile <= 1:
            raise ValueError("need floor_s > 0, factor >= 1 and 0 < percentile <= 1")
        self.floor_s = floor_s
        self.factor = factor
        self.percentile = percentile
        self._recent: deque[float] = deque(maxlen=window)

    def observe(self, step_seconds: float) -> None:
        self._recent.append(step_seconds)

    def seconds(self) -> float:
        """The deadline for the next step."""
        if not self._recent:
            return self.floor_s
        ordered = sorted(self._recent)
        high = ordered[min(len(ordered) - 1, int(self.percentile * len(ordered)))]
        return max(self.floor_s, self.factor * high)
