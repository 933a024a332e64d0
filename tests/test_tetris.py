"""Tetris: batch-wide selection of the draft prefixes most likely to be accepted."""

from __future__ import annotations

import math
import random

import pytest

from minedraft.sampling.tetris import tetris_select


def test_hand_computed_selection() -> None:
    # Scores: request 0 -> 0.9, 0.45, 0.225; request 1 -> 0.8, 0.64; request 2 has no drafts.
    probs = [[0.9, 0.5, 0.5], [0.8, 0.8], []]
    assert tetris_select(probs, 1) == [1, 0, 0]
    assert tetris_select(probs, 2) == [1, 1, 0]
    assert tetris_select(probs, 3) == [1, 2, 0]
    assert tetris_select(probs, 4) == [2, 2, 0]
    assert tetris_select(probs, 5) == [3, 2, 0]


def test_uses_cumulative_not_per_token_probability() -> None:
    # Request 1's second draft is individually likelier than request 0's, but its prefix is not.
    assert tetris_select([[0.95, 0.6], [0.5, 0.99]], 3) == [2, 1]


def test_capacity_edge_cases() -> None:
    probs = [[0.5, 0.5], [0.9]]
    assert tetris_select(probs, 0) == [0, 0]
    assert tetris_select(probs, 3) == [2, 1]
    assert tetris_select(probs, 100) == [2, 1]
    assert tetris_select([], 5) == []
    assert tetris_select([[], []], 2) == [0, 0]
    with pytest.raises(ValueError):
        tetris_select(probs, -1)


def test_ties_prefer_earlier_positions_then_lower_request_index() -> None:
    # All scores 0.5 (probabilities 1 after the first): earlier positions first, then request order.
    probs = [[0.5, 1.0, 1.0], [0.5, 1.0]]
    assert tetris_select(probs, 1) == [1, 0]
    assert tetris_select(probs, 2) == [1, 1]
    assert tetris_select(probs, 3) == [2, 1]
    assert tetris_select(probs, 4) == [2, 2]
    assert tetris_select([[0.7], [0.7], [0.7]], 2) == [1, 1, 0]


def test_out_of_range_probabilities_keep_prefixes() -> None:
    # A renormalised q can round above 1; NaN counts as 0. Neither may break the prefix shape.
    assert tetris_select([[0.5, 1.0000001, 1.0000001], [0.5]], 2) == [1, 1]
    assert tetris_select([[float("nan"), 0.9], [0.1]], 1) == [0, 1]
    assert tetris_select([[0.9, -0.2, 0.9], [0.05]], 2) == [1, 1]


def brute_force_value(probs: list[list[float]], keep: list[int]) -> float:
    return sum(math.prod(p[: j + 1]) for p, n in zip(probs, keep) for j in range(n))


def test_random_inputs_give_optimal_prefixes() -> None:
    rng = random.Random(0)
    for _ in range(500):
        probs = [
            [rng.choice([rng.random(), 0.5, 1.0]) for _ in range(rng.randint(0, 6))] for _ in range(rng.randint(0, 8))
        ]
        total = sum(map(len, probs))
        capacity = rng.randint(0, total + 2)
        keep = tetris_select(probs, capacity)
        assert len(keep) == len(probs)
        assert all(0 <= n <= len(p) for n, p in zip(keep, probs))  # a prefix of each request
        assert sum(keep) == min(capacity, total)
        # Optimal: every kept score is at least every dropped next-in-line score.
        kept = [math.prod(p[:n]) for p, n in zip(probs, keep) if n > 0]
        next_up = [math.prod(p[: n + 1]) for p, n in zip(probs, keep) if n < len(p)]
        if kept and next_up:
            assert min(kept) >= max(next_up) - 1e-12
        # On small cases, brute force: no other prefix choice of the same size has a larger total score.
        if len(probs) <= 3 and total <= 8:
            best = max(
                brute_force_value(probs, list(c))
                for c in _prefix_choices([len(p) for p in probs])
                if sum(c) == min(capacity, total)
            )
            assert brute_force_value(probs, keep) == pytest.approx(best)
        assert tetris_select(probs, capacity) == keep  # deterministic


def _prefix_choices(lengths: list[int]) -> list[tuple[int, ...]]:
    if not lengths:
        return [()]
    return [(n, *rest) for n in range(lengths[0] + 1) for rest in _prefix_choices(lengths[1:])]
