"""Online fits with forgetting, for choices made from what was measured here (the step shapes' cost model)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DECAY = 0.98  # forgetting per sample (the last ~50 samples carry a fit); docs/engine.md#tuning-constants


@dataclass
class Decayed:
    """A decayed sum of seconds and of what they bought (steps, tokens, work): each sample first multiplies both
    by the decay, then adds itself."""

    seconds: float = 0.0
    count: float = 0.0

    def add(self, seconds: float, count: float = 1.0, decay: float = DECAY) -> None:
        self.seconds = self.seconds * decay + seconds
        self.count = self.count * decay + count

    def per(self, empty: float = 0.0) -> float:
        """Seconds per unit counted (`empty` before anything was)."""
        return self.seconds / self.count if self.count > 0 else empty


class OnlineFit:
    """y ~ w . x by least squares on relative error (weight 1 / y^2) with exponential forgetting, every weight
    kept >= 0. Relative error, so that a long step does not outweigh the short ones the choice of k is about;
    a touch of ridge on every feature but the first (the fixed cost of a step or a forward), so that a feature
    that has not varied apart from it yet leaves it the cost: a cost is taken as fixed until the steps show that it
    grows with the requests or tokens (a ridge on all would split it among features that never varied, and a
    prediction for fewer requests than were ever seen would shrink with it)."""

    def __init__(self, features: int) -> None:
        self.xx = [[0.0] * features for _ in range(features)]
        self.xy = [0.0] * features
        self.count = 0

    def add(self, x: Sequence[float], y: float) -> None:
        w = 1.0 / (y * y)
        for i, xi in enumerate(x):
            self.xy[i] = self.xy[i] * DECAY + w * xi * y
            for j, xj in enumerate(x):
                self.xx[i][j] = self.xx[i][j] * DECAY + w * xi * xj
        self.count += 1

    def weights(self, *others: OnlineFit) -> list[float]:
        """Non-negative least squares by elimination: drop the most negative weight and solve again. `others`:
        fits of the same features whose samples count with this one's (each forgetting at its own pace)."""
        xx = [[sum(f.xx[i][j] for f in (self, *others)) for j in range(len(self.xy))] for i in range(len(self.xy))]
        xy = [sum(f.xy[i] for f in (self, *others)) for i in range(len(self.xy))]
        active = list(range(len(xy)))
        while active:
            solution = _solve([[xx[i][j] for j in active] for i in active], [xy[i] for i in active],
                              [i > 0 for i in active])
            if solution is not None and min(solution) >= 0:
                weights = [0.0] * len(xy)
                for i, value in zip(active, solution):
                    weights[i] = value
                return weights
            active.pop(solution.index(min(solution)) if solution is not None else 0)
        return [0.0] * len(xy)


def _solve(a: list[list[float]], b: list[float], penalized: list[bool]) -> list[float] | None:
    """(A + ridge on the penalized features) w = b by Gaussian elimination with partial pivoting; None if A is
    empty, zero or singular."""
    n = len(b)
    ridge = 1e-6 * sum(a[i][i] for i in range(n))
    if ridge <= 0:
        return None
    m = [[a[i][j] + (ridge if i == j and (penalized[i] or n == 1) else 0.0) for j in range(n)] + [b[i]]
         for i in range(n)]  # fmt: skip
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0:
            return None
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            m[r] = [v - factor * p for v, p in zip(m[r], m[col])]
    w = [0.0] * n
    for i in reversed(range(n)):
        w[i] = (m[i][n] - sum(m[i][j] * w[j] for j in range(i + 1, n))) / m[i][i]
    return w


class Ratio:
    """How much slower a part runs beside the other part than alone: the decayed seconds of the steps that ran it
    beside the other over what the fit of the part alone predicts for the same work, with that fit as it is now
    (the fit is linear, so the decayed sum of the work is all it needs). One number, so that it holds wherever the
    fit alone holds: a fit of overlapped steps alone would see only the windows chosen, and extrapolate badly."""

    def __init__(self, features: int) -> None:
        self.work = [0.0] * features
        self.seconds = 0.0
        self.count = 0

    def add(self, x: Sequence[float], seconds: float) -> None:
        self.work = [w * DECAY + xi for w, xi in zip(self.work, x)]
        self.seconds = self.seconds * DECAY + seconds
        self.count += 1

    def value(self, alone: Sequence[float]) -> float:
        predicted = sum(w * x for w, x in zip(alone, self.work))
        return self.seconds / predicted if predicted > 0 else 1.0
