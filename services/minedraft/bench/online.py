"""Online benchmark: streamed requests against a running server, measured at the client.

One request generator for every backend (MineDraft gRPC, OpenAI completions, OpenAI chat; see
backends.py): requests are released at arrival times (all at once, or a gamma process of `request_rate`
per second whose `burstiness` is its shape: 1 is Poisson, lower is burstier; optionally ramped from one
rate to another), and a semaphore caps those in flight at `concurrency`. Latencies are measured from the
moment a request is sent, i.e. after it got past the concurrency cap: time waiting for a free slot in the
client is not counted, time queued in the server is. The figures are vLLM's (see records.py).
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from minedraft.bench.backends import Backend, Sampling, make_backend
from minedraft.bench.prompts import BenchRequest
from minedraft.bench.records import BenchResult, LatencyStats, RequestRecord
from minedraft.bench.report import format_result, to_dict, to_json
from minedraft.bench.server_metrics import ServerStepStats, scrape

__all__ = [
    "BenchResult", "LatencyStats", "RequestRecord", "Ramp", "arrival_times", "format_result", "run_online_bench",
    "run_online_bench_async", "to_dict", "to_json",
]  # fmt: skip
PROGRESS_INTERVAL_S = 5.0


@dataclass(frozen=True)
class Ramp:
    """Request rate rising (or falling) from `start` to `end` per second over the run."""

    strategy: str  # linear | exponential
    start: float
    end: float

    def rate(self, progress: float) -> float:
        if self.strategy == "linear":
            return self.start + (self.end - self.start) * progress
        return self.start * (self.end / self.start) ** progress


def arrival_times(
    n: int, request_rate: float | None, rng: random.Random, burstiness: float = 1.0, ramp: Ramp | None = None
) -> list[float]:
    """Seconds after the start at which each request is released: all at 0 without a rate; else gaps drawn
    from a gamma distribution of shape `burstiness` and mean 1 / rate (the ramp's rate at that request)."""
    if request_rate is None and ramp is None:
        return [0.0] * n
    times, t = [], 0.0
    for i in range(n):
        times.append(t)
        rate = ramp.rate(i / max(n - 1, 1)) if ramp else request_rate
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


class Progress:
    """A tqdm bar on a terminal; elsewhere (CI logs, files) a line on stdout every `interval` seconds."""

    def __init__(self, total: int, interval: float = PROGRESS_INTERVAL_S) -> None:
        self.total, self.done, self.failed, self.tokens = total, 0, 0, 0
        self.lines = not sys.stdout.isatty()
        self.bar = tqdm(total=total, desc="requests", unit="req", disable=self.lines)
        self.interval, self.start = interval, time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._report()) if self.lines else None

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += record.error is not None
        self.tokens += record.output_tokens if record.error is None else 0
        self.bar.update(1)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        return (f"progress: {self.done}/{self.total} requests done ({self.failed} failed), {elapsed:.0f} s, "
                f"{self.tokens / elapsed if elapsed else 0:.1f} output tok/s")  # fmt: skip

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            print(self.line(), flush=True)

    def close(self) -> None:
        self.bar.close()
        if self._task is not None:
            self._task.cancel()


async def _one(
    backend: Backend, index: int, request: BenchRequest, sampling: Sampling, seed: int | None,
    gate: asyncio.Semaphore, run_start: float, progress: Progress | None,
) -> RequestRecord:  # fmt: skip
    record = RequestRecord(index, arrival=time.perf_counter() - run_start, prompt_tokens=request.prompt_len or 0)
    async with gate:
        start = time.perf_counter()
        record.sent = start - run_start
        try:
            await backend.send(request, sampling, seed, record, start)
            record.e2el = time.perf_counter() - start
            if record.ttft is None:
                raise RuntimeError("the stream ended without output")
        except Exception as exc:  # noqa: BLE001 (any failure is a failed request, reported, not raised)
            record.error = f"{type(exc).__name__}: {exc}"
        if progress is not None:
            progress.update(record)
    return record


async def _dispatch(
    backend: Backend, requests: Sequence[BenchRequest], sampling: Sampling, concurrency: int,
    arrivals: list[float], seed: int | None, progress: bool | float,
) -> list[RequestRecord]:  # fmt: skip
    gate = asyncio.Semaphore(concurrency)
    tasks = []
    interval = PROGRESS_INTERVAL_S if progress is True else float(progress)
    bar = Progress(len(requests), interval) if progress else None
    try:
        start = time.perf_counter()
        for i, (request, at) in enumerate(zip(requests, arrivals)):
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            # Per-request seeds make sampled (temperature > 0) outputs reproducible across runs and servers.
            request_seed = None if seed is None else seed + i
            tasks.append(asyncio.create_task(_one(backend, i, request, sampling, request_seed, gate, start, bar)))
        return list(await asyncio.gather(*tasks))
    finally:
        if bar is not None:
            bar.close()


def _server_stats(metrics_url: str | None, before: dict[str, float] | None) -> ServerStepStats | None:
    """The second scrape; its failure costs the server statistics, not the run's client-side results."""
    if metrics_url is None or before is None:
        return None
    try:
        return ServerStepStats.from_scrapes(before, scrape(metrics_url))
    except ConnectionError as exc:
        print(f"warning: {exc}; reporting without server statistics", file=sys.stderr)
        return None


def _as_requests(prompts: Sequence[str | BenchRequest]) -> list[BenchRequest]:
    return [p if isinstance(p, BenchRequest) else BenchRequest(p) for p in prompts]


async def run_online_bench_async(
    target: str,
    prompts: Sequence[str | BenchRequest],
    *,
    concurrency: int,
    max_tokens: int,
    temperature: float,
    request_rate: float | None = None,
    burstiness: float = 1.0,
    ramp: Ramp | None = None,
    seed: int | None = 0,
    metrics_url: str | None = None,
    timeout: float | None = 600.0,
    top_p: float = 1.0,
    top_k: int = -1,
    ignore_eos: bool = False,
    stop: Sequence[str] | None = None,
    warmup: int = 0,
    progress: bool | float = True,
    label: str = "",
    backend: str = "minedraft-grpc",
    model: str | None = None,
    api_key: str | None = None,
    tokenizer: Any = None,
    percentiles: Sequence[float] = (99.0,),
    slo: dict[str, float] | None = None,
) -> BenchResult:
    """The coroutine behind `run_online_bench` (for callers that already run an event loop)."""
    requests = _as_requests(prompts)
    _validate(requests, concurrency, max_tokens, temperature, request_rate, timeout, warmup, burstiness, ramp)
    sampling = Sampling(max_tokens, temperature, top_p, top_k, ignore_eos, tuple(stop) if stop else None)
    client = make_backend(backend, target, timeout=timeout, model=model, api_key=api_key, tokenizer=tokenizer)
    try:
        mode = await client.open()
        if warmup:  # first-call allocations and thread start-up, kept out of the numbers and the scrape
            warm = requests[:warmup]
            await _dispatch(client, warm, sampling, concurrency, [0.0] * len(warm), seed, progress=False)
        before = scrape(metrics_url) if metrics_url else None
        arrivals = arrival_times(len(requests), request_rate, random.Random(seed), burstiness, ramp)
        start = time.perf_counter()
        records = await _dispatch(client, requests, sampling, concurrency, arrivals, seed, progress)
        duration = time.perf_counter() - start
    finally:
        await client.close()
    return BenchResult(
        client.target, concurrency, request_rate, max_tokens, temperature, duration, records,
        _server_stats(metrics_url, before), mode, label, backend, burstiness, tuple(percentiles), dict(slo or {}),
    )  # fmt: skip


def run_online_bench(target: str, prompts: Sequence[str | BenchRequest], **options: Any) -> BenchResult:
    """Send every prompt to the server at `target` as a stream and measure it; `run_online_bench_async`'s arguments,
    run in an event loop of its own.

    `target`: host:port for `backend="minedraft-grpc"` (the default), the base URL (http://host:port) for
    "openai" (/v1/completions) and "openai-chat" (/v1/chat/completions). `prompts`: strings, or
    BenchRequests that carry their own lengths (random datasets).
    `concurrency`: most requests in flight. `request_rate`: None sends as fast as the concurrency allows;
    otherwise requests arrive as a gamma process of that many per second (`burstiness`, its shape: 1 is
    Poisson) or, with `ramp`, at a rate moving from the ramp's start to its end; still capped by
    `concurrency`. `seed`: seeds the arrival times, and request i carries sampling seed `seed + i` (None:
    requests carry no seed). `metrics_url`: a MineDraft scheduler's Prometheus endpoint, scraped before and
    after the run for server-side step statistics (it must serve no other traffic meanwhile; an endpoint
    that cannot be read before the run raises ConnectionError). `timeout`: per-request deadline in seconds.
    Further options: top_p, top_k, ignore_eos, stop, warmup (requests sent before measuring), progress
    (False: none; True or seconds: a bar on a terminal, else a line on stdout that often), label, model and
    api_key (OpenAI backends; model default: the first the server lists), tokenizer (counts output tokens of
    a server that reports no usage), percentiles, slo ({'ttft': ms, 'tpot': ms, 'e2el': ms}, for goodput).
    Failed requests are recorded, not raised; an unreachable server raises ConnectionError.
    """
    return asyncio.run(run_online_bench_async(target, prompts, **options))


def _validate(
    requests: Sequence[BenchRequest],
    concurrency: int,
    max_tokens: int,
    temperature: float,
    request_rate: float | None,
    timeout: float | None,
    warmup: int,
    burstiness: float,
    ramp: Ramp | None,
) -> None:
    checks = [
        (len(requests) >= 1, "need at least one prompt"),
        (concurrency >= 1, f"concurrency must be >= 1, got {concurrency}"),
        (max_tokens >= 1, f"max_tokens must be >= 1, got {max_tokens}"),
        (temperature >= 0, f"temperature must be >= 0, got {temperature}"),
        (request_rate is None or request_rate > 0, f"request rate must be > 0 (or unset), got {request_rate}"),
        (timeout is None or timeout > 0, f"timeout must be > 0 seconds, got {timeout}"),
        (warmup >= 0, f"warmup must be >= 0, got {warmup}"),
        (burstiness > 0 and math.isfinite(burstiness), f"burstiness must be > 0, got {burstiness}"),
        (ramp is None or ramp.strategy in ("linear", "exponential"), "ramp-up strategy is linear or exponential"),
        (ramp is None or (ramp.start > 0 and ramp.end > 0), "ramp-up rates must be > 0 requests per second"),
        (ramp is None or request_rate is None, "a ramp-up sets the rate itself: give no request rate with it"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
