"""The search for a poison request (engine/quarantine.py), step by step; imports no torch.

A small world simulator drives it the way the step loop does: the requests that may run form the world;
a world holding a poison request fails, any other completes a step.
"""

from __future__ import annotations

import sys

import pytest

from minedraft.engine.quarantine import Quarantine


def _run(requests: list[str], poison: set[str], max_steps: int = 200) -> tuple[list[str], int]:
    """Step until every poison request is convicted; returns (convicted in order, failed steps)."""
    quarantine, alive, convicted, failures = Quarantine(), list(requests), [], 0
    for _ in range(max_steps):
        if not poison - set(convicted):
            return convicted, failures
        world = [r for r in alive if quarantine.may_run(r)]
        assert world, "the world emptied while requests wait: a search must always test someone"
        if poison & set(world):
            failures += 1
            found = quarantine.failed(world)
            if found is not None:
                convicted.append(found)
                alive.remove(found)
                quarantine.forget(found)
        else:
            quarantine.ran(world)
    raise AssertionError(f"not found after {max_steps} steps; convicted {convicted}")


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 64])
def test_one_poison_among_n_is_found_in_about_log2_n_failures(n: int) -> None:
    requests = [f"r{i}" for i in range(n)]
    for poison in requests:
        convicted, failures = _run(requests, {poison})
        assert convicted == [poison]
        assert failures <= n.bit_length() + 2


def test_two_poisons_are_both_found_and_no_innocent_is_convicted() -> None:
    requests = [f"r{i}" for i in range(16)]
    convicted, _ = _run(requests, {"r3", "r12"}, max_steps=400)
    assert sorted(convicted) == ["r12", "r3"]


def test_a_single_failure_suspects_nobody() -> None:
    quarantine = Quarantine()
    assert quarantine.failed(["a", "b"]) is None
    assert not quarantine.searching and quarantine.may_run("a") and quarantine.may_run("new")


def test_failures_with_nothing_in_common_start_no_search() -> None:
    quarantine = Quarantine()
    quarantine.failed(["a", "b"])
    assert quarantine.failed(["c", "d"]) is None and not quarantine.searching


def test_newcomers_wait_outside_during_a_search_and_come_back_after() -> None:
    quarantine = Quarantine()
    quarantine.failed(["a", "b", "x"])
    quarantine.failed(["a", "b", "y"])  # x and y were in one failure only: not suspects, but not proven either
    assert quarantine.suspects == ["a", "b"] and quarantine.testing == {"a"}
    assert quarantine.may_run("a")
    assert not any(quarantine.may_run(r) for r in ("b", "x", "y", "new"))
    assert quarantine.ran(["a"])  # a is cleared: b is tested alone next, beside a
    assert quarantine.testing == {"b"} and quarantine.may_run("a") and not quarantine.may_run("new")
    assert quarantine.ran(["a", "b"])  # every suspect ran: the failures had another cause
    assert not quarantine.searching and all(quarantine.may_run(r) for r in ("b", "x", "y", "new"))


def test_an_aborted_suspect_ends_the_search_when_it_was_the_last() -> None:
    quarantine = Quarantine()
    quarantine.failed(["a", "b"])
    quarantine.failed(["a", "b"])
    assert quarantine.forget("a")  # the one under test left: b is tested next
    assert quarantine.testing == {"b"}
    assert quarantine.forget("b") and not quarantine.searching


def test_a_failure_without_the_tested_requests_ends_the_search() -> None:
    quarantine = Quarantine()
    quarantine.failed(["a", "b", "c"])
    quarantine.failed(["a", "b", "c"])
    assert quarantine.failed(["z"]) is None and not quarantine.searching


def test_the_quarantine_imports_no_torch() -> None:
    assert "minedraft.engine.quarantine" in sys.modules
    # The scheduler's step loop imports it; the core's rule: pure logic stays free of heavy imports.
    import importlib.util
    from pathlib import Path

    source = Path(importlib.util.find_spec("minedraft.engine.quarantine").origin)
    assert "import torch" not in source.read_text()
