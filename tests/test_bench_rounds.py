"""The interleaved-rounds loop every benchmark times its settings with: order, alternation, the median."""

from __future__ import annotations

import pytest

from minedraft.bench.rounds import interleaved, median_by


def test_rounds_interleave_and_alternate() -> None:
    calls: list[tuple[int, str]] = []
    settings = {name: (lambda round_, name=name: calls.append((round_, name)) or f"{name}{round_}") for name in "ABC"}
    reported = []
    results = interleaved(settings, 3, report=lambda r, name, result: reported.append(result))
    assert calls == [(0, "A"), (0, "B"), (0, "C"), (1, "C"), (1, "B"), (1, "A"), (2, "A"), (2, "B"), (2, "C")]
    assert results == {"A": ["A0", "A1", "A2"], "B": ["B0", "B1", "B2"], "C": ["C0", "C1", "C2"]}
    assert reported == [f"{name}{r}" for r, name in calls]
    calls.clear()
    interleaved(settings, 2, alternate=False)
    assert calls == [(0, "A"), (0, "B"), (0, "C"), (1, "A"), (1, "B"), (1, "C")]
    with pytest.raises(ValueError, match="rounds"):
        interleaved(settings, 0)


def test_warm_up_rounds_run_alike_and_are_dropped() -> None:
    calls: list[tuple[int, str]] = []
    settings = {name: (lambda round_, name=name: calls.append((round_, name)) or round_) for name in "AB"}
    reported = []
    results = interleaved(settings, 2, warmup=1, report=lambda r, name, result: reported.append((r, name)))
    assert calls == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B")]
    assert results == {"A": [1, 2], "B": [1, 2]}  # round 0 warmed up
    assert reported == calls  # warm-up runs are reported too
    with pytest.raises(ValueError, match="warmup"):
        interleaved(settings, 1, warmup=-1)


def test_the_median_round() -> None:
    assert median_by([3.0, 1.0, 2.0], lambda x: x) == 2.0
    assert median_by([{"s": 4}, {"s": 1}], lambda r: r["s"]) == {"s": 4}  # of two, the upper one
