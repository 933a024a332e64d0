"""Multi-turn chat as a closed loop: each conversation sends its next turn when the previous answer is complete
(as chat clients do), all conversations at once; each turn's prompt is the whole history as text. Served
through any OpenAI-compatible server's streaming completions API; the prefix cache's hit rate comes from
the `vllm:prefix_cache_*` counters of the servers that hold the caches (behind a gateway: the groups')."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from minedraft.metrics import scrape

PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft: float
    answer: str


@dataclass
class Run:
    """One load under one setting."""

    seconds: float
    turns: list[Turn]
    output_tokens: int
    hit_rate: float

    def ttfts(self, later: bool) -> list[float]:
        """The first turns' TTFTs, or (`later`) those of every turn after the first."""
        return [t.ttft for t in self.turns if (t.turn > 0) == later]

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def later_ttft_p50(self) -> float | None:
        later = self.ttfts(True)
        return statistics.median(later) if later else None

    def answers(self) -> dict[tuple[int, int], str]:
        return {(t.conversation, t.turn): t.answer for t in self.turns}


@dataclass
class Workload:
    """A system prompt shared by every conversation ("" for none) and each conversation's user turns, as text."""

    system: str
    users: list[list[str]]  # [conversation][turn]


Send = Callable[[str], Awaitable[tuple[float, str, int]]]  # prompt -> (ttft, answer, output tokens)


async def converse(workload: Workload, send: Send) -> tuple[list[Turn], int]:
    """Every conversation at once; each turn waits for the previous answer. Returns the turns, output tokens."""
    import asyncio

    tokens = 0

    async def one(c: int) -> list[Turn]:
        nonlocal tokens
        prompt, turns = workload.system, []
        for t, user in enumerate(workload.users[c]):
            prompt += user
            ttft, answer, n = await send(prompt)
            tokens += n
            turns.append(Turn(c, t, ttft, answer))
            prompt += answer
        return turns

    results = await asyncio.gather(*(one(c) for c in range(len(workload.users))))
    return [turn for turns in results for turn in turns], tokens


class HttpServer:
    """Greedy streamed completions (EOS ignored) against `url`; the hit rate from `metrics_urls` (default: the
    server's own /metrics). `extra`: more body fields of every request."""

    def __init__(
        self, url: str, max_tokens: int, metrics_urls: Sequence[str] | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.metrics_urls = list(metrics_urls) if metrics_urls is not None else [f"{url}/metrics"]
        self.extra = dict(extra or {})

    async def run(self, workload: Workload) -> Run:
        import aiohttp

        before = self._counters()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
            async with session.get(f"{self.url}/v1/models") as response:
                model = (await response.json())["data"][0]["id"]

            async def send(prompt: str) -> tuple[float, str, int]:
                body = {"model": model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                        **self.extra}  # fmt: skip
                start, first, text, tokens = time.perf_counter(), None, [], 0
                async with session.post(f"{self.url}/v1/completions", json=body) as response:
                    response.raise_for_status()
                    async for raw in response.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[len("data: "):])
                        delta = "".join(c.get("text", "") for c in chunk.get("choices", []))
                        if delta and first is None:
                            first = time.perf_counter() - start
                        text.append(delta)
                        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                return first or 0.0, "".join(text), tokens

            start = time.perf_counter()
            turns, tokens = await converse(workload, send)
            seconds = time.perf_counter() - start
        after = self._counters()
        queries = after[0] - before[0]
        return Run(seconds, turns, tokens, (after[1] - before[1]) / queries if queries else 0.0)

    def _counters(self) -> tuple[float, float]:
        """(prefix cache queries, hits) summed over the metrics endpoints."""
        samples = [scrape(url) for url in self.metrics_urls]
        queries = sum(s.get(PREFIX_CACHE_QUERIES, 0.0) for s in samples)
        return queries, sum(s.get(PREFIX_CACHE_HITS, 0.0) for s in samples)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q`th percentile (0 of nothing)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else 0.0
