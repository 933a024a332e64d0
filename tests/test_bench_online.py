"""The online benchmark against a real local stack (MineDraft mode) on a tiny random checkpoint pair.

Only structural facts are asserted (everything succeeded, the counts agree with what the server
reported, percentiles are ordered, the server's step statistics are sane): never speed.
"""

from __future__ import annotations

import json
import math

import pytest

from minedraft.bench.online import BenchResult, format_result, run_online_bench, to_json
from minedraft.bench.server_metrics import ServerStepStats, scrape
from minedraft.launcher import LocalStack, free_port, scheduler_settings

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
        # One ITL per token after the first delta, so never more than the tokens after the first.
        assert len(r.itls) <= r.output_tokens - 1
    assert result.output_tokens == sum(r.completion_tokens for r in result.records)
    assert result.server is not None
    # The server counts the tokens it delivered: exactly what the clients received during the run.
    assert result.server.generation_tokens == result.output_tokens


def test_latencies_are_ordered(result: BenchResult) -> None:
    for summary in (result.ttft, result.itl, result.e2e):
        assert summary.count > 0
        assert 0 <= summary.p50 <= summary.p99 and summary.mean >= 0
    for r in result.records:
        assert r.ttft is not None and r.e2e is not None and 0 <= r.ttft <= r.e2e
    assert result.ttft.count == result.e2e.count == NUM_PROMPTS
    assert result.duration_s > 0 and result.output_throughput > 0 and result.request_throughput > 0


def test_speculative_statistics(result: BenchResult) -> None:
    drafts = sum(r.num_drafts for r in result.records)
    assert drafts > 0
    assert sum(r.num_accepted_tokens for r in result.records) <= sum(r.num_draft_tokens for r in result.records)
    assert result.mean_accepted_length is not None and 1.0 <= result.mean_accepted_length <= 1.0 + 3
    server = result.server
    assert server is not None and server.num_drafts == drafts


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
    assert "TTFT" in text and "overlap efficiency" in text
    data = json.loads(to_json(result, per_request=True))
    assert data["completed"] == NUM_PROMPTS and len(data["requests"]) == NUM_PROMPTS
    assert math.isclose(data["ttft_s"]["p50"], result.ttft.p50)
    assert data["server"]["steps"] == result.server.steps


def test_validation_fails_before_connecting() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        run_online_bench("127.0.0.1:1", ["x"], concurrency=0, max_tokens=4, temperature=0.0)
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
