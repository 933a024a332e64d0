"""The step protocol with plans sent ahead: a step is planned while the previous one runs.

In one process (`LLMEngine.local(max_in_flight=2)`) the same schedules run as over the services' streams,
so the protocol's edge cases are checked here step by step; the services' own streams are checked with
real processes (their failure paths under SIGKILL are in test_self_healing.py, which runs them too).
"""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from minedraft.bench.online import run_online_bench
from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.engine.engine import LLMEngine
from minedraft.sampling.params import SamplingParams
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

from services import TWO_PROCESSES

# Fixed k: these tests look at the overlap of the two parts, which adaptive k may turn off on tiny models.
SPEC = {"num_speculative_tokens": 3, "is_parallel": True, "adaptive": False}


def _engine(pair, max_in_flight: int = 2, **overrides) -> LLMEngine:
    target, draft = pair
    config = EngineConfig(model=target, speculative_config={**SPEC, "model": draft}, max_num_seqs=4,
                          max_model_len=64, device="cpu", batch_invariant=True, **overrides)  # fmt: skip
    return LLMEngine.local(config, max_in_flight=max_in_flight)


def _drain(engine: LLMEngine) -> None:
    for _ in range(2000):
        if not engine.has_unfinished() and not engine.in_flight:
            return
        engine.advance()
    raise AssertionError("the engine made no progress")


def _assert_workers_empty(engine: LLMEngine) -> None:
    for worker in (engine.executor.verifier, engine.executor.drafter):
        cache = worker.runner.kv_cache
        assert worker.num_active == 0 and cache.num_free_blocks == cache.num_blocks


def test_two_steps_are_in_flight_and_the_order_holds(pair) -> None:
    engine = _engine(pair)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    requests = [engine.add_request([5 + i, 6, 7], params) for i in range(6)]
    engine.advance()
    assert engine.in_flight == 1  # after one applied, the next is already out
    engine.submit_step()
    assert engine.in_flight == 2
    _drain(engine)
    assert all(len(r.output_ids) == 20 and r.finish_reason == "length" for r in requests)
    _assert_workers_empty(engine)


def test_tokens_of_a_request_aborted_while_its_step_is_in_flight_are_dropped(pair) -> None:
    engine = _engine(pair)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    victim = engine.add_request([9, 8, 7], params)
    other = engine.add_request([1, 2, 3], params)
    while len(victim.output_ids) < 5:
        engine.advance()
    engine.submit_step()  # both steps in flight carry the victim
    assert engine.in_flight == 2
    engine.abort_request(victim.request_id)
    seen = list(victim.output_ids)
    _drain(engine)
    assert victim.output_ids == seen and victim.finish_reason == "abort"
    assert len(other.output_ids) == 40
    _assert_workers_empty(engine)


def test_a_new_world_queues_the_held_requests_that_may_run_again(pair) -> None:
    """During a search for a poison request some requests wait outside the world (engine/quarantine.py);
    when a new world is formed after the search moved on or ended, exactly those that may not run stay out."""
    engine = _engine(pair)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first, second = engine.add_request([1, 2, 3], params), engine.add_request([4, 5, 6], params)
    engine.hold(second.request_id)
    assert not second.finished  # held, not aborted
    engine.restart(speculate=True, may_run=lambda r: r == second.request_id)  # the search tests the other now
    assert list(engine.held) == [first.request_id]
    engine.restart(speculate=True, may_run=lambda r: True)  # the search ended without a conviction
    assert not engine.held
    _drain(engine)
    assert len(first.output_ids) == len(second.output_ids) == 4


def test_a_request_that_finishes_in_flight_runs_once_more_within_its_cache(pair) -> None:
    """max_model_len 64: a request that ends exactly there is planned once more before its end is seen;
    the workers bound that step by the cache, and its extra tokens never reach the output."""
    engine = _engine(pair)
    request = engine.add_request([3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    _drain(engine)
    assert len(request.output_ids) == 60 and len(request.token_ids) == 64
    _assert_workers_empty(engine)


def test_planned_ahead_equals_one_in_flight(pair) -> None:
    outputs = []
    for max_in_flight in (1, 2):
        engine = _engine(pair, max_in_flight)
        params = SamplingParams(temperature=0, max_tokens=30)
        requests = [engine.add_request([2 + i, 40 + i], params) for i in range(8)]
        _drain(engine)
        outputs.append([r.output_ids for r in requests])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("depth", [1, 2])
def test_workers_report_step_and_idle_time_and_bench_shows_the_idle_share(pair, depth: int, tmp_path) -> None:
    target, draft = pair
    config = EngineConfig(model=target, speculative_config={**SPEC, "model": draft}, max_num_seqs=4,
                          max_model_len=96, device="cpu")  # fmt: skip
    port = free_port()
    settings = scheduler_settings(metrics_port=port, max_steps_in_flight=depth, log_stats_interval=0.2)
    with LocalStack(config, worker=TWO_PROCESSES, scheduler=settings, log_dir=tmp_path) as stack:
        url = f"http://127.0.0.1:{port}/metrics"
        result = run_online_bench(stack.address, ["def f():", "import os", "class A:"] * 4, concurrency=8,
                                  max_tokens=24, temperature=0.0, ignore_eos=True, metrics_url=url)  # fmt: skip
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert result.failed == 0
    for role in ("verifier", "drafter"):
        steps = re.search(rf'^minedraft:worker_step_seconds_count{{role="{role}"}} (\S+)$', text, re.M)
        idle = re.search(rf'^minedraft:worker_idle_seconds_sum{{role="{role}"}} (\S+)$', text, re.M)
        assert steps and float(steps.group(1)) > 0 and idle is not None
    shares = result.server.worker_idle_share
    assert set(shares) == {"verifier", "drafter"} and all(0.0 <= s < 1.0 for s in shares.values())
    # The operator's view in the log: capacity at start, then a stats line while requests ran.
    log = (tmp_path / "scheduler.log").read_text()
    assert re.search(r"SERVING in minedraft mode; KV cache \d+ blocks of 16 tokens .* of max_model_len 96", log)
    assert re.search(r"generation [\d.]+ tok/s, running \d+, waiting \d+, KV cache [\d.]+% used, draft acceptance "
                     r"[\d.]+%, prefix cache hit rate [\d.]+%, drafter idle [\d.]+%, verifier idle [\d.]+%",
                     log)  # fmt: skip


@pytest.mark.parametrize("depth", [1, 2])
def test_a_cancelled_stream_leaves_the_load_gauges_at_zero(pair, depth: int) -> None:
    """A request whose client went away may end in no step (always with one step in flight): the gauges must
    still come back to zero."""
    target, draft = pair
    config = EngineConfig(model=target, speculative_config={**SPEC, "model": draft}, max_num_seqs=4,
                          max_model_len=512, device="cpu")  # fmt: skip
    port = free_port()
    settings = scheduler_settings(metrics_port=port, max_steps_in_flight=depth)
    with LocalStack(config, scheduler=settings) as stack, Client(stack.address, retries=0, timeout=120) as client:
        url = f"http://127.0.0.1:{port}/metrics"
        stream = client.stream([1, 2, 3], max_tokens=400, temperature=0, ignore_eos=True)
        next(stream)
        assert _gauges(url)["running"] == 1
        stream.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 30
        while _gauges(url) != {"running": 0, "waiting": 0, "kv": 0} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gauges(url) == {"running": 0, "waiting": 0, "kv": 0}


def _gauges(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    names = {"running": "num_requests_running", "waiting": "num_requests_waiting", "kv": "kv_cache_usage_perc"}
    return {key: float(re.search(rf"^minedraft:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))
            for key, name in names.items()}  # fmt: skip
