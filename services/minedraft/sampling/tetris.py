"""MineDraft's Tetris: spend a batch-wide verification budget on the drafts most likely to survive.

Each request drafted extra tokens. Keeping draft j of request r is worth prod_{i<=j} q_{r,i}, the
drafter's own estimate that the whole prefix up to j is accepted. The ``capacity`` best scores over
the batch are kept; since a score never exceeds the one before it in the same request, the kept drafts
form a prefix of every request.
"""

from __future__ import annotations

import math


def _prefix_scores(probs: list[float]) -> list[float]:
    """Cumulative products, with each factor clamped to [0, 1] (NaN counts as 0). Multiplying by a
    factor <= 1 never increases a float, so the scores are non-increasing even under rounding."""
    scores, running = [], 1.0
    for q in probs:
        running *= min(1.0, max(0.0, q)) if not math.isnan(q) else 0.0
        scores.append(running)
    return scores


def tetris_select(draft_token_probs: list[list[float]], capacity: int) -> list[int]:
    """How many leading drafts each request keeps so that at most ``capacity`` drafts are kept in all,
    choosing the highest prefix scores. Ties go to the earlier position, then to the lower request
    index, which keeps the choice deterministic and prefix-closed."""
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    keep = [0] * len(draft_token_probs)
    candidates = [
        (-score, position, r)
        for r, probs in enumerate(draft_token_probs)
        for position, score in enumerate(_prefix_scores(probs))
    ]
    for _, _, r in sorted(candidates)[:capacity]:
        keep[r] += 1
    return keep
