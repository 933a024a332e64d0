"""Prometheus metrics. Speculative-decoding counters follow vLLM's names with the `minedraft:` prefix.

The metrics whose meaning is the same as vLLM's are also exported under vLLM's own names
(`vllm:spec_decode_num_drafts_total`, `vllm:num_requests_running`, ...) with vLLM's `model_name` label, so
that `vllm bench serve` and the vLLM Grafana dashboards read them unchanged. They are the same series
renamed at scrape time (no second count that could drift); `minedraft:` stays the name of record.
"""

from __future__ import annotations

import collections
import urllib.request
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from minedraft.engine.adaptive import StepChoice
from minedraft.engine.plans import StepResult
from minedraft.engine.request import Request
from minedraft.settings import ListenError

# Names other modules read back (benchmarks, the gateway's routing), in one place.
STEP_SECONDS = "minedraft:step_seconds"
DRAFT_STEP_SECONDS = "minedraft:draft_step_seconds"
VERIFY_STEP_SECONDS = "minedraft:verify_step_seconds"
STEP_OVERLAP_RATIO = "minedraft:step_overlap_ratio"
NUM_DRAFTS = "minedraft:spec_decode_num_drafts"
NUM_ACCEPTED_TOKENS = "minedraft:spec_decode_num_accepted_tokens"
GENERATION_TOKENS = "minedraft:generation_tokens"
WORKER_STEP_SECONDS = "minedraft:worker_step_seconds"
WORKER_IDLE_SECONDS = "minedraft:worker_idle_seconds"
NUM_REQUESTS_WAITING = "minedraft:num_requests_waiting"
NUM_REQUESTS_RUNNING = "minedraft:num_requests_running"
CHOSEN_K = "minedraft:spec_decode_chosen_k"
PLAIN_STEPS = "minedraft:spec_decode_plain_steps"
STEPS_BY_SHAPE = "minedraft:spec_decode_steps_by_shape"
PREFIX_CACHE_QUERIES = "minedraft:prefix_cache_queries"  # the verifier's (the target model's), as vLLM's
PREFIX_CACHE_HITS = "minedraft:prefix_cache_hits"
DRAFT_PREFIX_CACHE_QUERIES = "minedraft:draft_prefix_cache_queries"
DRAFT_PREFIX_CACHE_HITS = "minedraft:draft_prefix_cache_hits"
KV_CACHE_USAGE = "minedraft:kv_cache_usage_perc"
ITL_SECONDS = "minedraft:inter_token_latency_seconds"
PREFILL_SECONDS = "minedraft:request_prefill_time_seconds"
PROMPT_TOKENS = "minedraft:prompt_tokens"
CACHE_CONFIG = "minedraft:cache_config_info"
LORA_REQUESTS = "minedraft:lora_requests_info"

_FINE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


# Ours -> vLLM's (v1 engine) name, for metrics that measure the same thing.
VLLM_NAMES = {
    NUM_DRAFTS: "vllm:spec_decode_num_drafts",
    "minedraft:spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    NUM_ACCEPTED_TOKENS: "vllm:spec_decode_num_accepted_tokens",
    "minedraft:spec_decode_num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
    GENERATION_TOKENS: "vllm:generation_tokens",
    "minedraft:request_success": "vllm:request_success",
    "minedraft:time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    ITL_SECONDS: "vllm:request_time_per_output_token_seconds",
    "minedraft:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    NUM_REQUESTS_WAITING: "vllm:num_requests_waiting",
    NUM_REQUESTS_RUNNING: "vllm:num_requests_running",
    PREFIX_CACHE_QUERIES: "vllm:prefix_cache_queries",
    PREFIX_CACHE_HITS: "vllm:prefix_cache_hits",
    KV_CACHE_USAGE: "vllm:kv_cache_usage_perc",
    CACHE_CONFIG: "vllm:cache_config_info",
    LORA_REQUESTS: "vllm:lora_requests_info",
    "minedraft:num_preemptions": "vllm:num_preemptions",
    PROMPT_TOKENS: "vllm:prompt_tokens",
    "minedraft:time_between_outputs_seconds": "vllm:inter_token_latency_seconds",
    "minedraft:request_queue_time_seconds": "vllm:request_queue_time_seconds",
    PREFILL_SECONDS: "vllm:request_prefill_time_seconds",
    "minedraft:request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "minedraft:request_inference_time_seconds": "vllm:request_inference_time_seconds",
}
_VLLM_LABELS = {"finish_reason": "finished_reason"}  # vLLM's label name on request_success


class VllmNames(Collector):
    """Re-exports the registry's metrics listed in VLLM_NAMES under vLLM's names and labels."""

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self._source = source
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            name = VLLM_NAMES.get(family.name)
            if name is None:
                continue
            renamed = Metric(name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = {_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}
                renamed.add_sample(name + sample.name[len(family.name) :], {"model_name": self._model_name, **labels},
                                   sample.value, sample.timestamp, sample.exemplar)  # fmt: skip
            yield renamed


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str | None = None) -> None:
        """`model_name` set: also export the vLLM-compatible names (see VllmNames)."""
        self.registry = registry or CollectorRegistry()
        self._declare_requests(self.registry)
        self._declare_speculation(self.registry)
        self._declare_cache(self.registry)
        self._declare_steps(self.registry)
        self._cache_config: dict[str, str] = {}
        self._members_bound: set[str] = set()  # the pool drafters this group was ever bound to
        self._rebinds_seen = 0
        if model_name is not None:
            ours, self.registry = self.registry, CollectorRegistry()
            self.registry.register(_Everything(ours))
            self.registry.register(VllmNames(ours, model_name))

    def _declare_requests(self, r: CollectorRegistry) -> None:
        """Per request: tokens, latencies, outcomes, the queue."""
        self.generation_tokens = Counter(
            GENERATION_TOKENS, "Tokens delivered to clients (after stop conditions)", registry=r
        )
        self.requests = Counter("minedraft:request_success", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram(
            "minedraft:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            ITL_SECONDS,
            "Mean time per output token after the first",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "minedraft:e2e_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.output_gap = Histogram(
            "minedraft:time_between_outputs_seconds", "Time between a request's consecutive outputs (one per step "
            "that gave it tokens, however many)", buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            PROMPT_TOKENS, "Prompt tokens of the requests that got their first token", registry=r
        )
        self.phases = {
            phase: Histogram(f"minedraft:request_{phase}_time_seconds", help_text, buckets=_LATENCY_BUCKETS, registry=r)
            for phase, help_text in (
                ("queue", "Time from arrival to the first step that ran the request"),
                ("prefill", "Time from the request's first step to its first token"),
                ("decode", "Time from the request's first token to its end"),
                ("inference", "Time from the request's first step to its end"),
            )
        }
        self.waiting = Gauge(NUM_REQUESTS_WAITING, "Requests waiting for a batch", registry=r)
        self.running = Gauge(NUM_REQUESTS_RUNNING, "Requests in a batch", registry=r)
        self.lora_requests = Gauge(
            LORA_REQUESTS, "The LoRA adapters of the running and the waiting requests (comma-joined names), as "
            "vLLM's; the value is the time of the last update (set after every step)",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r,
        )  # fmt: skip
        self.preemptions = Counter(
            "minedraft:num_preemptions", "Requests preempted (KV dropped, prefilled again) for lack of KV blocks",
            registry=r,
        )
        self.quarantined_requests = Counter(
            "minedraft:quarantined_requests", "Requests failed alone because every engine step they were in failed",
            registry=r,
        )

    def _declare_speculation(self, r: CollectorRegistry) -> None:
        """How the server speculates: drafts, acceptance, the shapes and k chosen."""
        self.num_drafts = Counter(NUM_DRAFTS, "Verifications carrying drafts", registry=r)
        self.num_draft_tokens = Counter("minedraft:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.num_accepted_tokens = Counter(
            NUM_ACCEPTED_TOKENS, "Draft tokens accepted", registry=r
        )
        self.accepted_per_pos = Counter(
            "minedraft:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the window",
            ["position"],
            registry=r,
        )
        self.decoding = Gauge(
            "minedraft:decoding_info", "How the server decodes (1 for its one label set)",
            ["mode", "draft_method", "num_speculative_tokens", "speculation"], registry=r,
        )  # fmt: skip
        self.chosen_k = Counter(
            CHOSEN_K, "Draft windows by the k adaptive speculation chose for them (0: the request decoded plainly)",
            ["k"], registry=r,
        )  # fmt: skip
        self.plain_steps = Counter(
            PLAIN_STEPS, "Decisions of adaptive speculation to draft nothing in a step (plain decoding)", registry=r
        )
        self.steps_by_shape = Counter(
            STEPS_BY_SHAPE, "Steps planned, by shape: plain (nothing drafted), sd (one batch drafts, then is "
            "verified; both halves count), overlap (drafting beside verification)", ["shape"], registry=r,
        )  # fmt: skip

    def _declare_cache(self, r: CollectorRegistry) -> None:
        """The KV cache: usage, layout, prefix hits."""
        self.kv_usage = Gauge(
            KV_CACHE_USAGE, "Share of the KV blocks charged to running requests (1 = full)", registry=r
        )
        self.cache_config = Gauge(
            CACHE_CONFIG, "The verifier's KV cache (1 for its one label set), as vLLM's: what the Kubernetes "
            "inference gateway's endpoint picker reads for prefix-aware scheduling",
            ["block_size", "num_gpu_blocks"], registry=r,
        )  # fmt: skip
        self.prefix_cache = {  # role -> (queries, hits), both in prompt tokens
            "verifier": (
                Counter(PREFIX_CACHE_QUERIES, "Prompt tokens the verifier looked up in its prefix cache", registry=r),
                Counter(PREFIX_CACHE_HITS, "Prompt tokens the verifier found in its prefix cache", registry=r),
            ),
            "drafter": (
                Counter(DRAFT_PREFIX_CACHE_QUERIES, "Prompt tokens the drafter looked up in its prefix cache",
                        registry=r),
                Counter(DRAFT_PREFIX_CACHE_HITS, "Prompt tokens the drafter found in its prefix cache", registry=r),
            ),
        }

    def _declare_steps(self, r: CollectorRegistry) -> None:
        """Per step: its time, its parts', the workers' and their idle gaps."""
        self.worker_step_seconds = Histogram(
            WORKER_STEP_SECONDS, "A step's time on a worker, from its plan received to its reply sent",
            ["role"], buckets=_FINE_BUCKETS, registry=r,
        )  # fmt: skip
        self.worker_idle_seconds = Histogram(
            WORKER_IDLE_SECONDS, "A worker's wait for the next plan while requests are running (the "
            "gap between steps; on a GPU, the GPU's idle time)", ["role"], buckets=_FINE_BUCKETS, registry=r,
        )  # fmt: skip
        self.step_seconds = Histogram(STEP_SECONDS, "Step time", buckets=_LATENCY_BUCKETS, registry=r)
        self.draft_seconds = Histogram(
            DRAFT_STEP_SECONDS, "Drafting time per step", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.verify_seconds = Histogram(
            VERIFY_STEP_SECONDS, "Verification time per step", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.pool_queue = Gauge(
            "minedraft:drafter_pool_queue", "Other groups' draft parts waiting at this group's pool drafter for its "
            "model, as of the last step that drafted", registry=r,
        )  # fmt: skip
        self.pool_wait_seconds = Histogram(
            "minedraft:drafter_pool_wait_seconds", "A step's wait at the pool drafter for its shared model",
            buckets=_FINE_BUCKETS, registry=r,
        )  # fmt: skip
        self.pool_bound = Gauge("minedraft:drafter_pool_bound", "1 for the pool drafter this group drafts with",
                                ["member"], registry=r)  # fmt: skip
        self.pool_rebinds = Counter("minedraft:drafter_pool_rebinds", "Bindings to another pool drafter than the "
                                    "one before (it died or drains)", registry=r)  # fmt: skip
        self.overlap = Histogram(
            STEP_OVERLAP_RATIO,
            "max(draft, verify) / step time for steps that ran both (1 = perfect overlap)",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0, 1.5),
            registry=r,
        )

    def record_binding(self, member: str | None, rebinds: int) -> None:
        """The pool drafter the group drafts with now (None: none, target-only), and its rebinds so far."""
        if member is not None:
            self._members_bound.add(member)
        for seen in self._members_bound:  # one series per member ever bound; only one reads 1
            self.pool_bound.labels(member=seen).set(1 if seen == member else 0)
        self.pool_rebinds.inc(rebinds - self._rebinds_seen)
        self._rebinds_seen = rebinds

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        try:
            start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise ListenError("--metrics-port", f"{addr}:{port}", exc.strerror or str(exc)) from exc

    def record_step(self, result: StepResult, was_busy: bool = True) -> None:
        """`was_busy`: requests were running when the previous step ended, so the workers' wait for this
        step's plan is a bubble in the pipeline (not a quiet server)."""
        for role, seconds in result.worker_seconds.items():
            self.worker_step_seconds.labels(role=role).observe(seconds)
            if was_busy:
                self.worker_idle_seconds.labels(role=role).observe(result.idle_seconds[role])
        self.step_seconds.observe(result.step_seconds)
        for role, queries in result.prefix_cache_queries.items():
            if role in self.prefix_cache:
                self.prefix_cache[role][0].inc(queries)
                self.prefix_cache[role][1].inc(result.prefix_cache_hits[role])
        if result.draft_seconds:
            self.draft_seconds.observe(result.draft_seconds)
        if result.verify_seconds:
            self.verify_seconds.observe(result.verify_seconds)
        if result.draft_seconds and result.verify_seconds and result.step_seconds:
            self.overlap.observe(max(result.draft_seconds, result.verify_seconds) / result.step_seconds)
        if result.draft_seconds and "drafter" in result.worker_seconds:
            self.pool_queue.set(result.drafter_queue)
            self.pool_wait_seconds.observe(result.drafter_wait_seconds)
        for verified in result.verified:
            if verified.num_draft_tokens:
                self.num_drafts.inc()
                self.num_draft_tokens.inc(verified.num_draft_tokens)
                self.num_accepted_tokens.inc(verified.num_accepted)
                for pos in range(verified.num_accepted):
                    self.accepted_per_pos.labels(position=str(pos)).inc()
        if result.choice is not None:
            self._record_choice(result.choice)

    def _record_choice(self, choice: StepChoice) -> None:
        """How the step was chosen (the record it carried in flight): its shape and, where adaptive speculation
        decided it, each request's window and whether it drafted nothing."""
        self.steps_by_shape.labels(shape=choice.shape.value).inc()
        if choice.windows is None:
            return
        for k, count in collections.Counter(choice.windows).items():
            self.chosen_k.labels(k=str(k)).inc(count)
        if choice.plain:
            self.plain_steps.inc()

    def declare_decoding(self, decoding: dict[str, str], num_speculative_tokens: int, adaptive: bool) -> None:
        """How the server decodes (`decoding_info`), and the speculation series it will export, at 0 from the
        start (a series that appears only with its first count leaves dashboards and alerts blind until then,
        and a server whose adaptive speculation decodes plainly might never show it)."""
        self.decoding.labels(**decoding).set(1)
        for position in range(num_speculative_tokens):
            self.accepted_per_pos.labels(position=str(position))
        for k in range(num_speculative_tokens + 1) if adaptive else ():
            self.chosen_k.labels(k=str(k))

    def record_cache_config(self, num_blocks: int, block_size: int) -> None:
        """The KV pool's shape; a new world may bring another one, which replaces it."""
        labels = {"block_size": str(block_size), "num_gpu_blocks": str(num_blocks)}
        if self._cache_config != labels:
            self.cache_config.clear()
            self.cache_config.labels(**labels).set(1)
            self._cache_config = labels

    def record_lora(self, running: list[str], waiting: list[str], max_lora: int) -> None:
        """The adapters in use now: one series, replaced at each update (vLLM's would pile up a series per
        combination ever seen; readers take the newest, which is the only one here)."""
        self.lora_requests.clear()
        self.lora_requests.labels(running_lora_adapters=",".join(running), waiting_lora_adapters=",".join(waiting),
                                  max_lora=str(max_lora)).set_to_current_time()  # fmt: skip

    def record_output(self, request: Request, gap_s: float | None) -> None:
        """A step gave `request` tokens; `gap_s`: the time since its previous output (None: the first)."""
        if gap_s is None:
            self.prompt_tokens.inc(len(request.prompt_ids))
        else:
            self.output_gap.observe(gap_s)

    def record_finished(self, request: Request) -> None:
        self.requests.labels(finish_reason=request.finish_reason or "unknown").inc()
        if request.first_token_time is None or request.finish_time is None:
            return
        self.ttft.observe(request.first_token_time - request.arrival_time)
        self.e2e.observe(request.finish_time - request.arrival_time)
        if len(request.output_ids) > 1:
            self.itl.observe((request.finish_time - request.first_token_time) / (len(request.output_ids) - 1))
        self.phases["decode"].observe(request.finish_time - request.first_token_time)
        started = request.scheduled_time
        if started is not None:
            self.phases["queue"].observe(started - request.arrival_time)
            self.phases["prefill"].observe(request.first_token_time - started)
            self.phases["inference"].observe(request.finish_time - started)


class _Everything(Collector):
    """Every metric of another registry (so that one registry serves ours and the renamed ones)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        return self._source.collect()


Samples = dict[str, float]


def scrape(url: str, timeout: float = 10.0) -> Samples:
    """Every sample of the endpoint, summed over label sets, keyed by sample name (`..._sum`, `..._total`),
    and per worker role, chosen k or draft position too (`name{verifier}`, `name{4}`).

    Buckets and `_created` timestamps are dropped: only sums and counts are differenced. Raises
    ConnectionError when the endpoint cannot be read.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (a URL the user gave)
            text = response.read().decode("utf-8")
    except (OSError, ValueError) as exc:  # URLError is an OSError; ValueError: not a URL at all
        raise ConnectionError(f"cannot scrape Prometheus metrics at {url}: {exc}") from exc
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
            for label in ("role", "k", "position"):
                value = sample.labels.get(label)
                if value is not None:
                    key = f"{sample.name}{{{value}}}"
                    samples[key] = samples.get(key, 0.0) + sample.value
    return samples
