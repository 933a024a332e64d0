"""What a benchmark run measured: one record per request, and the run's figures under vLLM's definitions.

vLLM's figures, with vLLM's names and meanings (so that ours and `vllm bench serve`'s read alike):

- TTFT: from sending a request to the first streamed chunk that carries output.
- ITL: the gap between two successive chunks that carry output (one value per gap, however many tokens
  a chunk holds: speculative decoding streams bursts, and ITL is then the time between bursts).
- TPOT: per request, (E2EL - TTFT) / (output tokens - 1): the mean time per token after the first.
- E2EL: from sending a request to the end of its stream.
- throughputs: input, output and total tokens of the successful requests per second of the run; goodput:
  successful requests per second whose TTFT, TPOT and E2EL all meet the `--slo` limits.

Ours, beside them under their own names: mean accepted length and tokens per chunk (where the stream says
how many tokens a chunk holds), acceptance per draft position, and the server's step statistics.
A chunk carries output unless it is empty and only closes the stream, announces a chat reply's role or
reports the usage: those are not chunks here, for TTFT and ITL alike (vLLM's client counts every chunk
with a choice; the two agree on servers that put the finish reason on the last text chunk and announce the
role after the first token). An empty chunk mid-stream counts: it brings tokens whose bytes the server
holds back until a character is complete.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from minedraft.bench.server_metrics import ServerStepStats

LATENCIES = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = ("ttft", "tpot", "e2el")  # vLLM's goodput keys; limits in milliseconds


@dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds; `error` set when it failed."""

    index: int
    arrival: float | None = None  # seconds after the run's start at which the generator released it
    sent: float | None = None  # ... at which it was sent (past the client's concurrency cap)
    ttft: float | None = None  # send -> first chunk carrying output
    e2el: float | None = None  # send -> end of the stream
    chunk_times: list[float] = field(default_factory=list)  # send -> each chunk carrying output
    chunk_tokens: list[int | None] = field(default_factory=list)  # tokens per chunk; None where not said
    token_ids: list[int] = field(default_factory=list)  # the tokens, where the stream carries them (gRPC)
    text: str = ""
    prompt_tokens: int = 0  # the server's usage, else the dataset's count
    completion_tokens: int = 0  # the server's usage, else the tokens counted at the client
    finish_reason: str | None = None
    num_drafts: int = 0  # speculative statistics, where the server reports them per request (gRPC, or HTTP
    # from a server with per-request spec decode metrics on)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    error: str | None = None

    def on_chunk(self, since_send: float, text: str, token_ids: Sequence[int] | None) -> None:
        """A chunk carrying output arrived `since_send` seconds after the request was sent."""
        if self.ttft is None:
            self.ttft = since_send
        self.chunk_times.append(since_send)
        self.chunk_tokens.append(None if token_ids is None else len(token_ids))
        self.text += text
        if token_ids is not None:
            self.token_ids.extend(token_ids)

    @property
    def output_tokens(self) -> int:
        """The server's completion tokens, else the tokens the stream carried."""
        return self.completion_tokens or len(self.token_ids)

    @property
    def itls(self) -> list[float]:
        """Gaps between successive chunks carrying output."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None or self.e2el is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def meets(self, slo: dict[str, float]) -> bool:
        """Whether every limit of `slo` (milliseconds) holds; an undefined TPOT (one token) holds."""
        values = {"ttft": self.ttft, "tpot": self.tpot or 0.0, "e2el": self.e2el}
        return all(values[key] is not None and values[key] * 1e3 <= limit for key, limit in slo.items())


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median, standard deviation (numpy's, over the population) and chosen percentiles (numpy's linear
    interpolation) of a latency, in seconds; NaN when nothing was measured."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]
    count: int

    @classmethod
    def of(cls, values: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
        if not values:
            return cls(math.nan, math.nan, math.nan, dict.fromkeys(percentiles, math.nan), 0)
        arr = np.asarray(values, dtype=np.float64)
        points = {p: float(np.percentile(arr, p)) for p in percentiles}
        return cls(float(arr.mean()), float(np.median(arr)), float(arr.std()), points, len(arr))


def parse_percentiles(text: str) -> tuple[float, ...]:
    """'50,90,99' -> (50.0, 90.0, 99.0); each in (0, 100]."""
    try:
        values = tuple(float(p) for p in text.replace(" ", ",").split(",") if p)
    except ValueError as exc:
        raise ValueError(f"percentiles must be numbers like 50,90,99, got {text!r}") from exc
    if not values or not all(0 < p <= 100 for p in values):
        raise ValueError(f"percentiles must lie in (0, 100], got {text!r}")
    return values


def parse_slo(items: Sequence[str] | str | None) -> dict[str, float]:
    """'ttft:200,tpot:50' (or separate 'KEY:MS' items, as vLLM's --goodput) -> {'ttft': 200.0, 'tpot': 50.0}."""
    if not items:
        return {}
    parts = [p for item in ([items] if isinstance(items, str) else items) for p in item.replace(" ", ",").split(",")]
    slo = {}
    for part in filter(None, parts):
        key, _, value = part.partition(":")
        if key not in SLO_KEYS:
            raise ValueError(f"--slo keys are {', '.join(SLO_KEYS)}; got {key!r} in {part!r}")
        try:
            slo[key] = float(value)
        except ValueError as exc:
            raise ValueError(f"--slo wants KEY:MILLISECONDS, got {part!r}") from exc
        if slo[key] <= 0:
            raise ValueError(f"--slo limits must be > 0 ms, got {part!r}")
    return slo


@dataclass
class BenchResult:
    """A run's configuration, its per-request records and, with a metrics URL, the server's step statistics."""

    target: str
    concurrency: int
    request_rate: float | None
    max_tokens: int
    temperature: float
    duration_s: float  # first request sent -> last request done
    records: list[RequestRecord]
    server: ServerStepStats | None = None
    server_mode: str = ""  # the server's own report (ar, sd, pearl, minedraft); "" if it did not say
    label: str = ""  # a name for comparison tables (the mode with --launch, the concurrency in a sweep)
    backend: str = "minedraft-grpc"
    burstiness: float = 1.0
    percentiles: tuple[float, ...] = (99.0,)
    slo: dict[str, float] = field(default_factory=dict)

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
    def input_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.ok)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    def _per_second(self, count: float) -> float:
        return count / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def request_throughput(self) -> float:
        return self._per_second(len(self.ok))

    @property
    def input_throughput(self) -> float:
        return self._per_second(self.input_tokens)

    @property
    def output_throughput(self) -> float:
        return self._per_second(self.output_tokens)

    @property
    def total_token_throughput(self) -> float:
        return self._per_second(self.input_tokens + self.output_tokens)

    @property
    def request_goodput(self) -> float | None:
        """Successful requests per second that met every `slo` limit; None without limits."""
        return self._per_second(sum(r.meets(self.slo) for r in self.ok)) if self.slo else None

    def _stats(self, values: list[float]) -> LatencyStats:
        return LatencyStats.of(values, self.percentiles)

    @property
    def ttft(self) -> LatencyStats:
        return self._stats([r.ttft for r in self.ok if r.ttft is not None])

    @property
    def tpot(self) -> LatencyStats:
        return self._stats([t for r in self.ok if (t := r.tpot) is not None])

    @property
    def itl(self) -> LatencyStats:
        return self._stats([x for r in self.ok for x in r.itls])

    @property
    def e2el(self) -> LatencyStats:
        return self._stats([r.e2el for r in self.ok if r.e2el is not None])

    def latency(self, name: str) -> LatencyStats:
        return getattr(self, name)

    @property
    def mean_accepted_length(self) -> float | None:
        """1 + sum accepted / sum drafts over the successful requests: tokens per verification that carried
        drafts (the target's own token included). None where the server reports no drafts per request."""
        drafts = sum(r.num_drafts for r in self.ok)
        return 1.0 + sum(r.num_accepted_tokens for r in self.ok) / drafts if drafts else None

    @property
    def acceptance_per_position(self) -> list[float]:
        """Per draft position: the share of verifications carrying drafts that accepted it, from the streams'
        statistics (gRPC), else from the server's counters (--metrics-url); [] if neither tells."""
        drafts = sum(r.num_drafts for r in self.ok)
        width = max((len(r.accepted_per_pos) for r in self.ok), default=0)
        if not drafts or not width:
            return self.server.acceptance_per_position if self.server else []
        sums = [sum(r.accepted_per_pos[i] for r in self.ok if i < len(r.accepted_per_pos)) for i in range(width)]
        return [s / drafts for s in sums]

    @property
    def mean_tokens_per_chunk(self) -> float | None:
        """Output tokens per chunk where the stream says (gRPC; None over HTTP, whose chunks carry text)."""
        counts = [n for r in self.ok for n in r.chunk_tokens if n is not None]
        return sum(counts) / len(counts) if counts else None
