"""Interleaved rounds: the one loop that times several settings on a shared, noisy machine.

Each round runs every setting once, in turn, so that what the machine does meanwhile (another process, a
thermal step, a cache warming up) falls on all settings alike; with `alternate` the order reverses every
other round (A B, then B A), so that no setting always runs right after the same other one. Each
setting's median round is what a comparison should report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def interleaved(
    settings: Mapping[K, Callable[[int], T]],
    rounds: int,
    *,
    warmup: int = 0,
    alternate: bool = True,
    settle_s: float = 0.0,
    report: Callable[[int, K, T], None] | None = None,
) -> dict[K, list[T]]:
    """`settings[name](round)` for every setting, `rounds` times, interleaved; returns each setting's results
    in round order. `warmup`: rounds run first, the same way, whose results are dropped (rounds are numbered
    from the first of them, so round `warmup` is the first kept). `settle_s`: seconds idle before each run
    (the previous run's threads spin a while). `report(round, name, result)` after each run (progress lines),
    warm-up runs included."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got {rounds} and {warmup}")
    results: dict[K, list[T]] = {name: [] for name in settings}
    for round_ in range(warmup + rounds):
        order = list(settings.items())
        if alternate and round_ % 2:
            order.reverse()
        for name, run in order:
            if settle_s:
                time.sleep(settle_s)
            result = run(round_)
            if round_ >= warmup:
                results[name].append(result)
            if report is not None:
                report(round_, name, result)
    return results


def median_by(results: list[T], key: Callable[[T], float]) -> T:
    """The result whose `key` is the median (the upper one of an even count)."""
    return sorted(results, key=key)[len(results) // 2]
