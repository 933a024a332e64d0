"""The gateway's choice of group: serving ones only, least outstanding work, its schedulers' reports."""

from __future__ import annotations

import pytest

from minedraft.gateway.policies import Placement, Predicted
from minedraft.gateway.pool import Backend, Measured, Pool
from minedraft.gateway.service import parse_backend
from minedraft.metrics import Metrics, scrape
from minedraft.stack.local import free_port


def _pool(*backends: Backend) -> Pool:
    pool = Pool()
    pool.backends = {b.address: b for b in backends}
    return pool


def _backend(address: str, serving: bool = True, requests: int = 0, tokens: int = 0) -> Backend:
    return Backend(address, channel=None, stub=None, serving=serving, requests=requests, tokens=tokens)


def test_least_outstanding_requests_then_tokens_among_serving_groups() -> None:
    a, b, c = _backend("a", requests=2), _backend("b", requests=1, tokens=500), _backend("c", requests=1, tokens=10)
    assert _pool(a, b, c).pick(set()) is c
    c.serving = False
    assert _pool(a, b, c).pick(set()) is b
    assert _pool(_backend("x", serving=False)).pick(set()) is None


def test_a_group_to_avoid_is_taken_only_when_no_other_serves() -> None:
    a, b = _backend("a"), _backend("b", requests=5)
    assert _pool(a, b).pick({"a"}) is b
    assert _pool(a).pick({"a"}) is a


def test_the_schedulers_queue_counts_what_other_gateways_sent() -> None:
    mine, busy = _backend("mine", requests=1), _backend("busy", requests=0)
    busy.take_report(6)  # other gateway replicas keep 6 requests there
    assert _pool(mine, busy).pick(set()) is mine
    busy.take_report(0)
    busy.sent_since_report = 0
    assert _pool(mine, busy).pick(set()) is busy
    mine.take_report(0)  # a report older than this gateway's own requests never hides them
    assert mine.load == (1, 0)


def _measure_burst(requests: int, tokens: int = 24, step_s: float = 0.01) -> Measured:
    """A group's speed as the gateway reads it from a real scheduler /metrics: `requests` requests of `tokens`
    tokens ran together, one token per step, and all came and went between two scrapes (the running gauge
    read 0 at both)."""
    metrics, port = Metrics(), free_port()
    metrics.serve(port, addr="127.0.0.1")
    measured, url = Measured(), f"http://127.0.0.1:{port}/metrics"
    measured.update(scrape(url))
    for _ in range(tokens):
        metrics.step_seconds.observe(step_s)
    metrics.generation_tokens.inc(requests * tokens)
    for _ in range(requests):
        metrics.itl.observe(step_s)
    measured.update(scrape(url))
    return measured


def test_a_burst_between_two_scrapes_is_measured_at_the_batch_it_ran() -> None:
    """8 requests at 10 ms per token ran at a batch of 8, not of 1 (as the gauges, read at the scrapes, would
    say): `predicted` then spreads 12 requests over two groups that measured the same."""
    bursts, alone = [_measure_burst(requests=8), _measure_burst(requests=8)], _measure_burst(requests=1)
    assert [(m.token_seconds, m.running) for m in bursts] == [(pytest.approx(0.01), pytest.approx(8))] * 2
    assert alone.running == pytest.approx(1)
    policy = Predicted()
    policy.max_num_seqs = 8
    groups = [_backend("a"), _backend("b")]
    groups[0].measured, groups[1].measured = bursts
    for _ in range(12):
        policy.choose(groups, Placement([1, 2, 3], 24)).requests += 1
    assert [g.requests for g in groups] == [6, 6]


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [("10.0.0.1:50051", ("10.0.0.1:50051", None)),
     ("sched:50051@7450", ("sched:50051", "http://sched:7450/metrics"))],
)  # fmt: skip
def test_backend_specs(spec: str, parsed) -> None:
    assert parse_backend(spec) == parsed


@pytest.mark.parametrize("spec", ["10.0.0.1", "host:port", "h:1@x", ":50051"])
def test_bad_backend_specs_say_what_is_expected(spec: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT or HOST:PORT@METRICS_PORT"):
        parse_backend(spec)
