"""Interleaved rounds: the one loop that times several settings on a shared, noisy machine.

Each round runs every setting once, in turn, so that what the machine does meanwhile (another process, a
thermal step, a cache warming up) falls on all settings alike; with `alternate` the order reverses every
other round (A B, then B A), so that no setting always runs right after the same other one. Each
setting's median round is what a comparison should report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def interleaved(
    settings: Mapping[str, Callable[[int], T]],
    rounds: int,
    *,
    alternate: bool = True,
    settle_s: float = 0.0,
    report: Callable[[int, str, T], None] | None = None,
) -> dict[str, list[T]]:
    """`settings[name](round)` for every setting, `rounds` times, interleaved; returns each setting's results
    in round order. `settle_s`: seconds idle before each run (the previous run's threads spin a while).
    `report(round, name, result)` after each run (progress lines)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    results: dict[str, list[T]] = {name: [] for name in settings}
    for round_ in range(rounds):
        order = list(settings.items())
        if alternate and round_ % 2:
            order.reverse()
        for name, run in order:
            if settle_s:
                time.sleep(settle_s)
            result = run(round_)
            results[name].append(result)
            if report is not None:
                report(round_, name, result)
    return results


def median_by(results: list[T], key: Callable[[T], float]) -> T:
    """The result whose `key` is the median (the upper one of an even count)."""
    return sorted(results, key=key)[len(results) // 2]
