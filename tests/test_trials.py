"""Trials (`engine/adaptive/trials.py`) as tables: how often the choice among candidates changes, with noise, bursts of
other work, probes that back off and predictions that put a candidate out of reach. No models, no clocks."""

from __future__ import annotations

import random
from collections.abc import Callable

from minedraft.engine.adaptive.trials import Trials


def _run_trials(trials: Trials, costs: dict[str, float], picks: int, noise: float, rng: random.Random) -> list[str]:
    """`picks` picks of one kind on a machine where each candidate costs `costs[c]` per unit, +- `noise`."""
    chosen = []
    for _ in range(picks):
        choice = trials.pick("load", list(costs))
        chosen.append(choice)
        trials.add("load", choice, costs[choice] * (1 + rng.uniform(-noise, noise)), 1.0)
    return chosen


def _switches(chosen: list[str]) -> int:
    return sum(a != b for a, b in zip(chosen, chosen[1:]))


def test_candidates_within_the_margin_do_not_take_turns() -> None:
    """Two candidates 1% apart with 5% noise per sample: the one in use stays; the other runs only in probes."""
    trials = Trials(run=4, probe_every=128, decay=0.9)
    chosen = _run_trials(trials, {"a": 1.00, "b": 1.01}, 4096, noise=0.05, rng=random.Random(0))
    # Without a margin the two swapped places whenever noise reordered them (hundreds of switches); with it,
    # the switches are the probes' (two per probe, the probes backing off) and at most a few settled swaps.
    assert _switches(chosen) <= 2 * 12 + 4, _switches(chosen)


def test_probes_back_off_while_nothing_changes_and_return_when_the_cost_moves() -> None:
    trials = Trials(run=4, probe_every=128, decay=0.9)
    rng = random.Random(1)
    chosen = _run_trials(trials, {"fast": 1.0, "slow": 2.0}, 8192, noise=0.02, rng=rng)
    probes = chosen.count("slow") // 4 - 1  # the first run is its first try
    assert probes <= 12, probes  # at 128, 256, 512, then every 1024 picks (64 probes without backing off)
    # The machine changes: "fast" now costs 1.8 (still below what "slow" last measured) and "slow" 1.2. The cost
    # of the one in use moved, so the next probe comes within the base interval (not the ~900 picks the backed
    # off schedule had left) and finds "slow" faster.
    chosen = _run_trials(trials, {"fast": 1.8, "slow": 1.2}, 512, noise=0.02, rng=rng)
    assert chosen.index("slow") <= 128 + 8 and chosen[-256:].count("slow") >= 240, chosen.index("slow")


def _settled_picks(trials: Trials, cost: Callable[[int, str], float], picks: int) -> list[str]:
    """`picks` picks of one kind where a pick of `c` costs `cost(pick, c)` per unit; as the engine does, the first
    two steps of a run of one candidate do not count (they carry the switch)."""
    chosen: list[str] = []
    for pick in range(picks):
        choice = trials.pick("load", ["a", "b"])
        chosen.append(choice)
        if chosen[-3:] == [choice] * 3:
            trials.add("load", choice, cost(pick, choice), 1.0)
    return chosen


def test_first_tries_interleave_so_that_a_burst_during_one_does_not_decide() -> None:
    """"a" costs 1.0 and "b" 1.2 per unit, but a burst of other work makes "a"'s first run cost 1.5. Tried once
    each, "b" is settled on until the first probe; tried in three interleaved runs each, "a" is."""
    def cost(pick: int, choice: str) -> float:
        return {"a": 1.0, "b": 1.2}[choice] * (1.5 if choice == "a" and pick < 4 else 1.0)

    once = _settled_picks(Trials(run=4, probe_every=128, decay=0.9), cost, 100)
    assert once[:8] == ["a"] * 4 + ["b"] * 4 and set(once[8:]) == {"b"}
    interleaved = _settled_picks(Trials(run=4, probe_every=128, decay=0.9, first_runs=3), cost, 100)
    assert [interleaved[4 * run] for run in range(6)] == ["a", "b"] * 3
    assert set(interleaved[24:]) == {"a"}


def test_a_burst_on_the_candidate_in_use_does_not_hold_the_choice_on_the_dearer_one() -> None:
    """"a" (1.0 per unit) is in use when a burst of other work makes its steps cost 1.5 for 32 picks; "b" costs
    1.15. During the burst "a"'s estimate climbs past "b"'s and "b" runs, and it keeps the burst's steps while
    "b" runs. A probe of "a" is judged by its own runs (and, won twice, they replace "a"'s estimate), so "b" runs
    about one probe interval after the burst; with the probes' two steps blended into the burst's, "b" ran to the
    end (1,360 of 1,372 picks)."""
    def cost(pick: int, choice: str) -> float:
        return {"a": 1.0, "b": 1.15}[choice] * (1.5 if 96 <= pick < 128 else 1.0)

    chosen = _settled_picks(Trials(run=4, probe_every=128, decay=0.9, first_runs=3), cost, 1500)
    assert chosen[24:96] == ["a"] * 72
    assert chosen[128:].count("b") <= 128 + 4 * 8, chosen[128:].count("b")


def test_a_probe_that_wins_once_runs_again_before_the_choice_changes() -> None:
    """A probe's run (two counted steps) that measures its candidate cheaper, here by the 3% margin, does not
    switch: the candidate in use runs a run, then the probed one again, and only a second win switches."""
    costs = {"a": 1.0, "b": 1.2}
    trials = Trials(run=4, probe_every=128, decay=0.9, first_runs=3)
    chosen = _settled_picks(trials, lambda pick, c: costs[c], 127)  # the first probe starts at the 128th pick
    assert chosen[24:] == ["a"] * 103
    costs["b"] = 0.9  # from the probe on, "b" is cheaper
    chosen = _settled_picks(trials, lambda pick, c: costs[c], 32)
    assert chosen[:16] == ["b"] * 4 + ["a"] * 4 + ["b"] * 4 + ["b"] * 4, chosen
    assert set(chosen[8:]) == {"b"}
    # A probe that wins once by chance and loses its second run changes nothing.
    trials = Trials(run=4, probe_every=128, decay=0.9, first_runs=3)
    costs = {"a": 1.0, "b": 1.2}
    _settled_picks(trials, lambda pick, c: costs[c], 127)
    chosen = _settled_picks(trials, lambda pick, c: costs[c] * (0.7 if c == "b" and pick < 4 else 1.0), 64)
    assert chosen[:12] == ["b"] * 4 + ["a"] * 4 + ["b"] * 4 and set(chosen[12:]) == {"a"}, chosen


def test_a_probe_runs_only_for_a_candidate_that_could_win() -> None:
    """Scaled by a prediction, a candidate out of reach (it would lose measured 15% cheaper than the cheapest
    measured) is not probed: such probes only cost (offline at 8 in flight on 2 cores, 6% of the default's time).
    Once the prediction brings it within reach, the probes return within the base interval."""
    trials = Trials(run=4, probe_every=128, decay=0.9, first_runs=3)
    scale, costs = {"a": 1.0, "b": 1.5}, {"a": 1.0, "b": 1.0}

    def picks(n: int) -> list[str]:
        chosen: list[str] = []
        for _ in range(n):
            choice = trials.pick("load", ["a", "b"], scale)
            chosen.append(choice)
            if chosen[-3:] == [choice] * 3:
                trials.add("load", choice, costs[choice], 1.0)
        return chosen

    chosen = picks(2000)
    assert chosen[:24] == (["a"] * 4 + ["b"] * 4) * 3 and set(chosen[24:]) == {"a"}
    scale["b"] = 1.1  # predicted 10% dearer: within reach, though not cheaper by the margin as measured
    chosen = picks(256)
    assert "b" in chosen[:128 + 4] and chosen.count("b") <= 8, chosen.count("b")
