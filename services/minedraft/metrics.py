"""Prometheus metrics. Speculative-decoding counters follow vLLM's names with the `minedraft:` prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from minedraft.engine.plans import StepResult
from minedraft.engine.request import Request

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, max_positions: int = 32) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter("minedraft:spec_decode_num_drafts", "Verifications carrying drafts", registry=r)
        self.num_draft_tokens = Counter("minedraft:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.num_accepted_tokens = Counter(
            "minedraft:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.accepted_per_pos = Counter(
            "minedraft:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the window",
            ["position"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "minedraft:generation_tokens", "Tokens delivered to clients (after stop conditions)", registry=r
        )
        self.requests = Counter("minedraft:request_success", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram(
            "minedraft:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "minedraft:inter_token_latency_seconds",
            "Mean time per output token after the first",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "minedraft:e2e_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.waiting = Gauge("minedraft:num_requests_waiting", "Requests waiting for a batch", registry=r)
        self.running = Gauge("minedraft:num_requests_running", "Requests in a batch", registry=r)
        self.kv_usage = Gauge(
            "minedraft:kv_cache_usage_perc", "Fraction of the workers' KV-cache slots in use (1 = full)", registry=r
        )
        self.step_seconds = Histogram("minedraft:step_seconds", "Step time", buckets=_LATENCY_BUCKETS, registry=r)
        self.draft_seconds = Histogram(
            "minedraft:draft_step_seconds", "Drafting time per step", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.verify_seconds = Histogram(
            "minedraft:verify_step_seconds", "Verification time per step", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.overlap = Histogram(
            "minedraft:step_overlap_ratio",
            "max(draft, verify) / step time for steps that ran both (1 = perfect overlap)",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0, 1.5),
            registry=r,
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr.strip("[]"), registry=self.registry)

    def record_load(self, waiting: int, running: int, num_slots: int) -> None:
        """Queue depth, running requests and KV usage: after each step, and when the engine goes idle
        (so that an idle server does not keep reporting its last step's load)."""
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv_usage.set(running / num_slots if num_slots else 0.0)

    def record_step(self, result: StepResult, waiting: int, running: int, num_slots: int = 0) -> None:
        self.record_load(waiting, running, num_slots)
        self.step_seconds.observe(result.step_seconds)
        if result.draft_seconds:
            self.draft_seconds.observe(result.draft_seconds)
        if result.verify_seconds:
            self.verify_seconds.observe(result.verify_seconds)
        if result.draft_seconds and result.verify_seconds and result.step_seconds:
            self.overlap.observe(max(result.draft_seconds, result.verify_seconds) / result.step_seconds)
        for verified in result.verified:
            if verified.num_draft_tokens:
                self.num_drafts.inc()
                self.num_draft_tokens.inc(verified.num_draft_tokens)
                self.num_accepted_tokens.inc(verified.num_accepted)
                for pos in range(verified.num_accepted):
                    self.accepted_per_pos.labels(position=str(pos)).inc()

    def record_finished(self, request: Request) -> None:
        self.requests.labels(finish_reason=request.finish_reason or "unknown").inc()
        if request.first_token_time is None or request.finish_time is None:
            return
        self.ttft.observe(request.first_token_time - request.arrival_time)
        self.e2e.observe(request.finish_time - request.arrival_time)
        if len(request.output_ids) > 1:
            self.itl.observe((request.finish_time - request.first_token_time) / (len(request.output_ids) - 1))
