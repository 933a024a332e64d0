"""The online benchmark over gRPC against a real local stack (MineDraft mode) on a tiny random checkpoint pair.

Only structural facts are asserted (everything succeeded, the counts agree with what the server
reported, vLLM's definitions hold record by record, percentiles are ordered, the server's step statistics
are sane): never speed. The OpenAI backends, the command line and the files: test_bench_http.py.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from minedraft.bench.online import BenchResult, Ramp, arrival_times, format_result, run_online_bench, to_json
from minedraft.bench.records import RequestRecord, parse_percentiles, parse_slo
from minedraft.bench.server_metrics import ServerStepStats, scrape
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

from conftest import tiny_config

NUM_PROMPTS, CONCURRENCY, MAX_TOKENS = 12, 4, 16


@pytest.fixture(scope="module")
def result(pair, tmp_path_factory) -> BenchResult:
    root = tmp_path_factory.mktemp("bench")
    # Fixed k: the step statistics below need overlapped steps, which adaptive k may turn off on tiny models.
    config = tiny_config(pair, {"num_speculative_tokens": 3, "is_parallel": True, "adaptive": False}, max_num_seqs=4,
                         batch_invariant=False)  # fmt: skip
    prompts = [f"def f{i}(x):\n    return x * {i}" for i in range(NUM_PROMPTS)]
    metrics_port = free_port()
    with LocalStack(config, scheduler=scheduler_settings(metrics_port=metrics_port), log_dir=root) as stack:
        return run_online_bench(
            stack.address, prompts, concurrency=CONCURRENCY, max_tokens=MAX_TOKENS, temperature=0.0, seed=0,
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics", timeout=120, warmup=1, progress=False,
            percentiles=(50, 90, 99),
        )  # fmt: skip


def test_every_request_succeeds(result: BenchResult) -> None:
    assert result.failed == 0, result.first_error
    assert len(result.ok) == NUM_PROMPTS and result.server_mode == "minedraft"
    assert sorted(r.index for r in result.records) == list(range(NUM_PROMPTS))
    assert all(r.finish_reason in ("stop", "length") for r in result.records)


def test_token_counts_match_the_servers_usage(result: BenchResult) -> None:
    for r in result.records:
        assert r.output_tokens == r.completion_tokens and 1 <= r.output_tokens <= MAX_TOKENS
        assert r.prompt_tokens > 0
        # gRPC deltas say how many tokens they carry: every chunk carries some, and they add up.
        assert sum(r.chunk_tokens) == r.output_tokens and min(r.chunk_tokens) >= 1
        assert len(r.itls) == len(r.chunk_times) - 1
    assert result.output_tokens == sum(r.completion_tokens for r in result.records)
    assert result.server is not None
    # The server counts the tokens it delivered: exactly what the clients received during the run.
    assert result.server.generation_tokens == result.output_tokens


def test_latencies_are_ordered(result: BenchResult) -> None:
    for stats in (result.ttft, result.tpot, result.itl, result.e2el):
        assert stats.count > 0 and stats.mean >= 0 and stats.std >= 0
        assert 0 <= stats.percentiles[50] == stats.median <= stats.percentiles[90] <= stats.percentiles[99]
    for r in result.records:
        assert r.ttft is not None and r.e2el is not None and 0 <= r.ttft <= r.e2el
        assert r.ttft == r.chunk_times[0] and r.chunk_times == sorted(r.chunk_times) and r.chunk_times[-1] <= r.e2el
    assert result.ttft.count == result.e2el.count == NUM_PROMPTS
    assert result.duration_s > 0 and result.output_throughput > 0 and result.request_throughput > 0


def test_vllm_definitions_hold_per_request(result: BenchResult) -> None:
    """TPOT is (E2EL - TTFT) / (tokens - 1) per request; ITL one value per gap between chunks, whatever their size."""
    for r in result.ok:
        assert math.isclose(r.tpot, (r.e2el - r.ttft) / (r.output_tokens - 1))
    assert result.itl.count == sum(len(r.chunk_times) - 1 for r in result.ok)
    assert math.isclose(result.tpot.mean, sum(r.tpot for r in result.ok) / NUM_PROMPTS)
    assert result.mean_tokens_per_chunk == result.output_tokens / sum(len(r.chunk_times) for r in result.ok)
    assert math.isclose(result.total_token_throughput, result.input_throughput + result.output_throughput)
    assert result.input_tokens == sum(r.prompt_tokens for r in result.records)


def test_speculative_statistics(result: BenchResult) -> None:
    drafts = sum(r.num_drafts for r in result.records)
    assert drafts > 0
    assert sum(r.num_accepted_tokens for r in result.records) <= sum(r.num_draft_tokens for r in result.records)
    assert result.mean_accepted_length is not None and 1.0 <= result.mean_accepted_length <= 1.0 + 3
    server = result.server
    assert server is not None and server.num_drafts == drafts
    # Position i is accepted only after position i - 1: the rates fall, and they sum to accepted / drafts.
    rates = result.acceptance_per_position
    assert rates == sorted(rates, reverse=True) and all(0 <= x <= 1 for x in rates)
    assert math.isclose(sum(rates), result.mean_accepted_length - 1)
    # The server's per-position counters over the run agree with the streams' per-request statistics.
    width = max(len(r.accepted_per_pos) for r in result.records)
    per_pos = [sum(r.accepted_per_pos[i] for r in result.records if i < len(r.accepted_per_pos)) for i in range(width)]
    while per_pos and not per_pos[-1]:
        per_pos.pop()
    assert server.accepted_per_pos == per_pos and server.acceptance_per_position == pytest.approx(rates[: len(per_pos)])


def test_server_step_statistics(result: BenchResult) -> None:
    s = result.server
    assert isinstance(s, ServerStepStats)
    assert s.steps > 0 and s.draft_steps > 0 and s.verify_steps > 0 and s.overlap_steps > 0
    assert s.overlap_steps <= min(s.draft_steps, s.verify_steps) <= s.steps
    assert min(s.mean_step_seconds, s.mean_draft_seconds, s.mean_verify_seconds) > 0
    assert 0 <= s.overlap_efficiency <= 1.5
    assert s.control_plane_overhead is not None and -0.5 <= s.control_plane_overhead <= 1.0


def test_report_and_json(result: BenchResult) -> None:
    text = format_result(result)
    for line in ("Mean TTFT (ms)", "P90 TPOT (ms)", "P99 ITL (ms)", "Median E2EL (ms)", "overlap efficiency"):
        assert line in text
    data = json.loads(to_json(result, per_request=True))
    assert data["completed"] == NUM_PROMPTS and len(data["requests"]) == NUM_PROMPTS
    assert math.isclose(data["median_ttft_ms"], result.ttft.median * 1e3)
    assert math.isclose(data["p99_itl_ms"], result.itl.percentiles[99] * 1e3)
    assert data["request_goodput"] is None  # no --slo
    assert data["minedraft"]["server"]["steps"] == result.server.steps


def test_validation_fails_before_connecting() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        run_online_bench("127.0.0.1:1", ["x"], concurrency=0, max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="burstiness"):
        run_online_bench("127.0.0.1:1", ["x"], concurrency=1, max_tokens=4, temperature=0.0, request_rate=1,
                         burstiness=0)  # fmt: skip
    with pytest.raises(ConnectionError, match="no MineDraft server"):
        run_online_bench("127.0.0.1:1", ["x"], concurrency=1, max_tokens=4, temperature=0.0, timeout=5)


def test_unreadable_metrics_endpoint_is_a_connection_error() -> None:
    with pytest.raises(ConnectionError, match="cannot scrape"):
        scrape(f"http://127.0.0.1:{free_port()}/metrics", timeout=5)


def _stats(**kw) -> ServerStepStats:
    zeros = dict.fromkeys(ServerStepStats.__dataclass_fields__, 0)
    return ServerStepStats(**{**zeros, **kw})


def test_overhead_is_exact_without_overlap_steps() -> None:
    # sd: 10 draft-only steps of 1 s and 10 verify-only steps of 2 s, 40 s of step time in all.
    s = _stats(steps=20, step_seconds_sum=40, draft_steps=10, draft_seconds_sum=10, verify_steps=10,
               verify_seconds_sum=20)  # fmt: skip
    assert math.isclose(s.control_plane_overhead, 1 - 30 / 40)
    assert s.overlap_efficiency is None


def test_overhead_when_every_step_overlaps_is_one_minus_the_mean_ratio() -> None:
    s = _stats(steps=4, step_seconds_sum=8, draft_steps=4, draft_seconds_sum=3, verify_steps=4,
               verify_seconds_sum=6, overlap_steps=4, overlap_ratio_sum=3.2)  # fmt: skip
    assert math.isclose(s.overlap_efficiency, 0.8)
    assert math.isclose(s.control_plane_overhead, 0.2)


def test_adaptive_choices_are_reported() -> None:
    s = _stats(chosen_k={0: 2, 4: 6}, plain_steps=2, worker_step_seconds_sum={}, worker_idle_seconds_sum={})
    assert s.mean_chosen_k == 3.0 and s.to_dict()["mean_chosen_k"] == 3.0
    assert _stats(chosen_k={}).mean_chosen_k is None  # fixed k or ar: no such line


def test_arrivals_keep_the_rate_and_burstiness_spreads_them() -> None:
    n, rate = 4000, 20.0
    assert arrival_times(3, None, random.Random(0)) == [0.0, 0.0, 0.0]
    for burstiness in (0.25, 1.0, 4.0):
        times = arrival_times(n, rate, random.Random(1), burstiness)
        gaps = [b - a for a, b in zip(times, times[1:])]
        mean = sum(gaps) / len(gaps)
        cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
        assert math.isclose(mean, 1 / rate, rel_tol=0.1)
        # A gamma distribution of shape b has coefficient of variation 1 / sqrt(b): lower b, burstier.
        assert math.isclose(cv, 1 / math.sqrt(burstiness), rel_tol=0.15)


def test_a_ramp_moves_the_rate_from_start_to_end() -> None:
    times = arrival_times(2001, None, random.Random(2), ramp=Ramp("linear", 5.0, 50.0))
    first, last = times[200] - times[0], times[-1] - times[-201]
    assert first > 3 * last  # 200 gaps near 5-ish req/s against 200 near 50-ish
    assert Ramp("exponential", 2.0, 32.0).rate(0.5) == pytest.approx(8.0)


def test_goodput_counts_requests_within_every_limit() -> None:
    fast = RequestRecord(0, ttft=0.1, e2el=0.5, completion_tokens=5)  # TPOT 100 ms
    slow_start = RequestRecord(1, ttft=0.3, e2el=0.4, completion_tokens=5)
    assert fast.meets({"ttft": 200, "tpot": 100}) and not fast.meets({"tpot": 99})
    assert not slow_start.meets({"ttft": 200}) and slow_start.meets({"e2el": 400})
    result = BenchResult("x", 1, None, 5, 0.0, 2.0, [fast, slow_start], slo={"ttft": 200.0})
    assert result.request_goodput == 0.5 and result.request_throughput == 1.0


def test_slo_and_percentile_parsing() -> None:
    assert parse_slo("ttft:200,tpot:50") == parse_slo(["ttft:200", "tpot:50"]) == {"ttft": 200.0, "tpot": 50.0}
    for bad, message in (("itl:5", "keys are"), ("ttft:x", "KEY:MILLISECONDS"), ("ttft:0", "> 0")):
        with pytest.raises(ValueError, match=message):
            parse_slo(bad)
    assert parse_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
    with pytest.raises(ValueError, match="in \\(0, 100\\]"):
        parse_percentiles("0,50")
