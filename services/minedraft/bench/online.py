"""Online benchmark: streamed requests against a running MineDraft server, measured at the client.

One asyncio loop sends every prompt through `AsyncClient.stream`; a semaphore caps the requests in
flight at `concurrency`, and with a `request_rate` requests are released at Poisson arrival times
(exponential gaps) instead of all at once. Latencies are measured per request from the moment it is
sent, i.e. after it got past the client's concurrency cap: time spent waiting for a free slot in the
benchmark client is not counted, time queued in the server is.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from minedraft.bench.server_metrics import ServerStepStats, scrape
from minedraft.client import AsyncClient, Delta


@dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds; `error` set when it failed."""

    index: int
    ttft: float | None = None  # send -> first delta carrying tokens
    e2e: float | None = None  # send -> last delta
    itls: list[float] = field(default_factory=list)  # one per token after the first delta, see `on_delta`
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0  # the server's usage
    completion_tokens: int = 0  # the server's usage (should equal len(token_ids))
    finish_reason: str | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        """Tokens received in the stream's deltas."""
        return len(self.token_ids)

    def on_delta(self, delta: Delta, since_send: float, since_last: float | None) -> None:
        """Record a delta. A delta of n tokens after the first adds n inter-token latencies, each the gap
        since the previous token-carrying delta divided by n: speculative decoding delivers tokens in
        bursts, and this spreads a burst's wait over its tokens (token-weighted, like TPOT)."""
        n = len(delta.token_ids)
        if n:
            if self.ttft is None:
                self.ttft = since_send
            elif since_last is not None:
                self.itls.extend([since_last / n] * n)
            self.token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            if delta.usage is not None:
                self.prompt_tokens = delta.usage.prompt_tokens
                self.completion_tokens = delta.usage.completion_tokens
            stats = delta.spec_decode_stats
            if stats is not None:
                self.num_drafts = stats.num_drafts
                self.num_draft_tokens = stats.num_draft_tokens
                self.num_accepted_tokens = stats.num_accepted_tokens


@dataclass(frozen=True)
class Summary:
    """Mean, median and 99th percentile (numpy's linear interpolation) of a latency, in seconds."""

    mean: float
    p50: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            return cls(math.nan, math.nan, math.nan, 0)
        arr = np.asarray(values, dtype=np.float64)
        return cls(float(arr.mean()), float(np.percentile(arr, 50)), float(np.percentile(arr, 99)), len(arr))


@dataclass
class BenchResult:
    """A run's configuration, per-request records and, with a metrics URL, the server's step statistics."""

    target: str
    concurrency: int
    request_rate: float | None
    max_tokens: int
    temperature: float
    duration_s: float  # first request sent -> last request done
    records: list[RequestRecord]
    server: ServerStepStats | None = None
    server_mode: str = ""  # the server's own report (ar, sd, pearl, minedraft); "" if it did not say
    label: str = ""  # a name for comparison tables (the mode, with --launch)

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None]

    @property
    def failed(self) -> int:
        return len(self.records) - len(self.ok)

    @property
    def first_error(self) -> str | None:
        return next((r.error for r in self.records if r.error is not None), None)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    @property
    def request_throughput(self) -> float:
        """Successful requests per second of wall time."""
        return len(self.ok) / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def output_throughput(self) -> float:
        """Output tokens of successful requests per second of wall time."""
        return self.output_tokens / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def ttft(self) -> Summary:
        """Over requests: send -> first token (queueing in the server and prefill included)."""
        return Summary.of([r.ttft for r in self.ok if r.ttft is not None])

    @property
    def itl(self) -> Summary:
        """Over all output tokens after each request's first delta (see `RequestRecord.on_delta`)."""
        return Summary.of([x for r in self.ok for x in r.itls])

    @property
    def e2e(self) -> Summary:
        """Over requests: send -> last delta."""
        return Summary.of([r.e2e for r in self.ok if r.e2e is not None])

    @property
    def mean_accepted_length(self) -> float | None:
        """1 + sum accepted / sum drafts over all successful requests: tokens per verification that
        carried drafts (the target's own token included). None without speculative decoding."""
        drafts = sum(r.num_drafts for r in self.ok)
        return 1.0 + sum(r.num_accepted_tokens for r in self.ok) / drafts if drafts else None


async def _one(
    client: AsyncClient, index: int, prompt: str, sampling: dict[str, Any], gate: asyncio.Semaphore, bar: tqdm
) -> RequestRecord:
    record = RequestRecord(index)
    async with gate:
        start = last = time.perf_counter()
        try:
            async for delta in client.stream(prompt, **sampling):
                now = time.perf_counter()
                record.on_delta(delta, now - start, now - last if record.ttft is not None else None)
                if delta.token_ids:
                    last = now
            record.e2e = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 (any failure is a failed request, reported, not raised)
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            bar.update(1)
    return record


def _arrival_times(n: int, request_rate: float | None, rng: random.Random) -> list[float]:
    """Seconds after the start at which each request is released: all at 0, or a Poisson process."""
    if request_rate is None:
        return [0.0] * n
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(request_rate)
    return times


async def _dispatch(
    client: AsyncClient,
    prompts: Sequence[str],
    sampling: dict[str, Any],
    concurrency: int,
    arrivals: list[float],
    seed: int | None,
    progress: bool,
) -> list[RequestRecord]:
    gate = asyncio.Semaphore(concurrency)
    tasks = []
    with tqdm(total=len(prompts), desc="requests", unit="req", disable=None if progress else True) as bar:
        start = time.perf_counter()
        for i, (prompt, at) in enumerate(zip(prompts, arrivals)):
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            # Per-request seeds make sampled (temperature > 0) outputs reproducible across runs and modes.
            request_sampling = {**sampling, "seed": None if seed is None else seed + i}
            tasks.append(asyncio.create_task(_one(client, i, prompt, request_sampling, gate, bar)))
        return list(await asyncio.gather(*tasks))


async def _server_mode(client: AsyncClient, target: str) -> str:
    """Fail fast, with a clear message, when nothing answers at `target`."""
    try:
        return (await client.server_info(timeout=10)).mode
    except Exception as exc:  # noqa: BLE001
        raise ConnectionError(f"no MineDraft server answers at {target}: {exc}") from exc


def _server_stats(metrics_url: str | None, before: dict[str, float] | None) -> ServerStepStats | None:
    """The second scrape; its failure costs the server statistics, not the run's client-side results."""
    if metrics_url is None or before is None:
        return None
    try:
        return ServerStepStats.from_scrapes(before, scrape(metrics_url))
    except ConnectionError as exc:
        print(f"warning: {exc}; reporting without server statistics", file=sys.stderr)
        return None


async def run_online_bench_async(
    target: str,
    prompts: Sequence[str],
    *,
    concurrency: int,
    max_tokens: int,
    temperature: float,
    request_rate: float | None = None,
    seed: int | None = 0,
    metrics_url: str | None = None,
    timeout: float | None = 600.0,
    top_p: float = 1.0,
    top_k: int = -1,
    ignore_eos: bool = False,
    stop: Sequence[str] | None = None,
    warmup: int = 0,
    progress: bool = True,
    label: str = "",
) -> BenchResult:
    """The coroutine behind `run_online_bench` (for callers that already run an event loop)."""
    _validate(prompts, concurrency, max_tokens, temperature, request_rate, timeout, warmup)
    sampling = {
        "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "ignore_eos": ignore_eos, "stop": stop,
    }  # fmt: skip
    # No client retries: a request the server refused is a failed request, and a retried one would
    # report a latency that includes the backoff.
    async with AsyncClient(target, timeout=timeout, retries=None) as client:
        mode = await _server_mode(client, target)
        if warmup:  # first-call allocations and thread start-up, kept out of the numbers and the scrape
            warm = prompts[:warmup]
            await _dispatch(client, warm, sampling, concurrency, [0.0] * len(warm), seed, progress=False)
        before = scrape(metrics_url) if metrics_url else None
        arrivals = _arrival_times(len(prompts), request_rate, random.Random(seed))
        start = time.perf_counter()
        records = await _dispatch(client, prompts, sampling, concurrency, arrivals, seed, progress)
        duration = time.perf_counter() - start
    server = _server_stats(metrics_url, before)
    return BenchResult(
        target, concurrency, request_rate, max_tokens, temperature, duration, records, server, mode, label
    )


def run_online_bench(
    target: str,
    prompts: Sequence[str],
    *,
    concurrency: int,
    max_tokens: int,
    temperature: float,
    request_rate: float | None = None,
    seed: int | None = 0,
    metrics_url: str | None = None,
    timeout: float | None = 600.0,
    **options: Any,
) -> BenchResult:
    """Send every prompt to the server at `target` (host:port) as a streamed Generate and measure it.

    `concurrency`: most requests in flight. `request_rate`: None sends as fast as the concurrency
    allows; otherwise requests arrive as a Poisson process of that many per second (still capped by
    `concurrency`). `seed`: seeds the arrival times, and request i carries sampling seed `seed + i`
    (None: requests carry no seed). `metrics_url`: the scheduler's Prometheus endpoint, scraped before
    and after the run for server-side step statistics (it must serve no other traffic meanwhile; an
    endpoint that cannot be read before the run raises ConnectionError).
    `timeout`: per-request deadline in seconds. Further options: top_p, top_k, ignore_eos, stop, warmup
    (requests sent before measuring), progress (tqdm bar on a terminal), label.
    Failed requests are recorded, not raised; an unreachable server raises ConnectionError.
    """
    return asyncio.run(
        run_online_bench_async(
            target, prompts, concurrency=concurrency, max_tokens=max_tokens, temperature=temperature,
            request_rate=request_rate, seed=seed, metrics_url=metrics_url, timeout=timeout, **options,
        )
    )  # fmt: skip


def _validate(
    prompts: Sequence[str],
    concurrency: int,
    max_tokens: int,
    temperature: float,
    request_rate: float | None,
    timeout: float | None,
    warmup: int,
) -> None:
    checks = [
        (len(prompts) >= 1, "need at least one prompt"),
        (concurrency >= 1, f"concurrency must be >= 1, got {concurrency}"),
        (max_tokens >= 1, f"max_tokens must be >= 1, got {max_tokens}"),
        (temperature >= 0, f"temperature must be >= 0, got {temperature}"),
        (request_rate is None or request_rate > 0, f"request rate must be > 0 (or unset), got {request_rate}"),
        (timeout is None or timeout > 0, f"timeout must be > 0 seconds, got {timeout}"),
        (warmup >= 0, f"warmup must be >= 0, got {warmup}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _fmt(value: float | None, fmt: str = ".2f", scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value * scale, fmt)


def format_result(result: BenchResult) -> str:
    """A human-readable report of one run."""
    rate = "as fast as concurrency allows" if result.request_rate is None else f"Poisson {result.request_rate:g}/s"
    lines = [
        f"MineDraft online benchmark: {result.target}" + (f" ({result.server_mode})" if result.server_mode else ""),
        f"  requests ok / failed        {len(result.ok)} / {result.failed}",
        f"  concurrency, arrivals       {result.concurrency}, {rate}",
        f"  max tokens, temperature     {result.max_tokens}, {result.temperature:g}",
        f"  duration (s)                {result.duration_s:.2f}",
        f"  request throughput (req/s)  {result.request_throughput:.2f}",
        f"  output throughput (tok/s)   {result.output_throughput:.1f}   ({result.output_tokens} tokens)",
        f"  mean accepted length        {_fmt(result.mean_accepted_length)}",
    ]
    if result.first_error:
        lines.append(f"  first error                 {result.first_error}")
    lines.append(f"  {'latency (ms)':<26}{'mean':>10}{'p50':>10}{'p99':>10}")
    for name, s in (("TTFT", result.ttft), ("ITL (per token)", result.itl), ("E2E", result.e2e)):
        lines.append(f"  {name:<26}{_fmt(s.mean, '.1f', 1e3):>10}{_fmt(s.p50, '.1f', 1e3):>10}"
                     f"{_fmt(s.p99, '.1f', 1e3):>10}")  # fmt: skip
    if result.server is not None:
        lines += _format_server(result.server)
    return "\n".join(lines)


def _format_server(s: ServerStepStats) -> list[str]:
    return [
        "  server (scheduler metrics over the run)",
        f"    steps                     {s.steps}  (draft {s.draft_steps}, verify {s.verify_steps},"
        f" both {s.overlap_steps})",
        f"    mean step / draft / verify (ms)  {_fmt(s.mean_step_seconds, '.2f', 1e3)} / "
        f"{_fmt(s.mean_draft_seconds, '.2f', 1e3)} / {_fmt(s.mean_verify_seconds, '.2f', 1e3)}",
        f"    control-plane overhead    {_fmt(s.control_plane_overhead, '.1%')}  (approximate)",
        f"    overlap efficiency        {_fmt(s.overlap_efficiency, '.2f')}",
        "    worker idle (% of wall)   "
        + (", ".join(f"{role} {share:.1%}" for role, share in s.worker_idle_share.items()) or "-"),
        f"    prefix cache hit rate     {_fmt(s.prefix_cache_hit_rate, '.1%')}  ({s.prefix_cache_hits} of "
        f"{s.prefix_cache_queries} prompt tokens)",
        *(
            [f"    adaptive k                mean {s.mean_chosen_k:.2f}, plain steps {s.plain_steps}  (windows by k: "
             + ", ".join(f"{k}: {n}" for k, n in sorted(s.chosen_k.items())) + ")"]
            if s.mean_chosen_k is not None else []
        ),
    ]


def to_dict(result: BenchResult, per_request: bool = False) -> dict[str, Any]:
    """Configuration, aggregate numbers (seconds, tokens/s) and optionally every request's record."""

    def summary(s: Summary) -> dict[str, float | int | None]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in s.__dict__.items()}

    data: dict[str, Any] = {
        "label": result.label,
        "target": result.target,
        "server_mode": result.server_mode,
        "concurrency": result.concurrency,
        "request_rate": result.request_rate,
        "max_tokens": result.max_tokens,
        "temperature": result.temperature,
        "duration_s": result.duration_s,
        "completed": len(result.ok),
        "failed": result.failed,
        "first_error": result.first_error,
        "output_tokens": result.output_tokens,
        "request_throughput": result.request_throughput,
        "output_throughput": result.output_throughput,
        "ttft_s": summary(result.ttft),
        "itl_s": summary(result.itl),
        "e2e_s": summary(result.e2e),
        "mean_accepted_length": result.mean_accepted_length,
        "server": result.server.to_dict() if result.server else None,
    }
    if per_request:
        data["requests"] = [{**r.__dict__, "itls": list(r.itls)} for r in result.records]
    return data


def to_json(results: BenchResult | dict[str, BenchResult], per_request: bool = False) -> str:
    """JSON of one result, or of several keyed by name (e.g. the modes of `minedraft bench --launch`)."""
    if isinstance(results, BenchResult):
        return json.dumps(to_dict(results, per_request), indent=2)
    return json.dumps({name: to_dict(r, per_request) for name, r in results.items()}, indent=2)
