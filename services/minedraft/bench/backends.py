"""How a benchmark talks to a server: MineDraft's gRPC stream, or OpenAI's HTTP API (completions or chat),
streamed as server-sent events. Every backend fills the same `RequestRecord`, chunk by chunk.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from minedraft.bench.prompts import BenchRequest
from minedraft.bench.records import RequestRecord

BACKENDS = ("minedraft-grpc", "openai", "openai-chat")


@dataclass(frozen=True)
class Sampling:
    """What every request of a run asks for (a dataset's output length replaces max_tokens)."""

    max_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    stop: tuple[str, ...] | None = None


class Backend(ABC):
    name: str
    target: str

    @abstractmethod
    async def open(self) -> str:
        """Connect and return the server's decoding mode ('' if it does not say); ConnectionError if nothing
        answers."""

    @abstractmethod
    async def send(
        self, request: BenchRequest, sampling: Sampling, seed: int | None, record: RequestRecord, start: float
    ) -> None:
        """Stream one request into `record` (times since `start`, a perf_counter reading); raise on failure."""

    async def close(self) -> None:
        return None


class GrpcBackend(Backend):
    """MineDraft's public gRPC API: deltas carry token ids, and the last one the request's draft statistics."""

    name = "minedraft-grpc"

    def __init__(self, target: str, timeout: float | None) -> None:
        from minedraft.client import AsyncClient

        self.target = target
        # No client retries: a refused request is a failed request, and a retried one's latency holds the backoff.
        self._client = AsyncClient(target, timeout=timeout, retries=None)

    async def open(self) -> str:
        try:
            return (await self._client.server_info(timeout=10)).mode
        except Exception as exc:  # noqa: BLE001 (any failure to answer is the same message)
            raise ConnectionError(f"no MineDraft server answers at {self.target}: {exc}") from exc

    async def send(
        self, request: BenchRequest, sampling: Sampling, seed: int | None, record: RequestRecord, start: float
    ) -> None:
        options = {**sampling.__dict__, "max_tokens": request.output_len or sampling.max_tokens, "seed": seed}
        async for delta in self._client.stream(request.prompt, **options):
            if delta.token_ids:
                record.on_chunk(time.perf_counter() - start, delta.text, delta.token_ids)
            if delta.finish_reason is not None:
                record.finish_reason = delta.finish_reason
                if delta.usage is not None:
                    record.prompt_tokens = delta.usage.prompt_tokens
                    record.completion_tokens = delta.usage.completion_tokens
                if (stats := delta.spec_decode_stats) is not None:
                    record.num_drafts, record.num_draft_tokens = stats.num_drafts, stats.num_draft_tokens
                    record.num_accepted_tokens = stats.num_accepted_tokens
                    record.accepted_per_pos = list(stats.num_accepted_tokens_per_pos)

    async def close(self) -> None:
        await self._client.close()


class OpenAIBackend(Backend):
    """An OpenAI-compatible server (`minedraft up --http-port`, `vllm serve`, ...) over HTTP with aiohttp.

    Asks for the usage in the stream (`stream_options.include_usage`) for the token counts; a server that
    sends none has its output tokens counted at the client with `tokenizer` (else one per chunk). A server
    that sends each request's speculative decoding counts (MineDraft's --per-request-spec-decode-metrics)
    has them read from the stream's last chunk."""

    def __init__(
        self, base_url: str, chat: bool, timeout: float | None, model: str | None = None,
        api_key: str | None = None, tokenizer: Any = None,
    ) -> None:  # fmt: skip
        self.name = "openai-chat" if chat else "openai"
        self.target = base_url.rstrip("/").removesuffix("/v1")
        self.chat, self.model, self.tokenizer, self._timeout = chat, model, tokenizer, timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: Any = None

    async def open(self) -> str:
        import aiohttp

        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout), connector=aiohttp.TCPConnector(limit=0),
            headers=self._headers,
        )  # fmt: skip
        try:
            async with self._session.get(f"{self.target}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as reply:
                reply.raise_for_status()
                models = (await reply.json())["data"]
        except aiohttp.ClientResponseError as exc:
            await self.close()
            hint = " (give the key: --api-key or $OPENAI_API_KEY)" if exc.status == 401 else ""
            raise ConnectionError(f"{self.target}/v1/models answered {exc.status} {exc.message}{hint}") from exc
        except Exception as exc:  # noqa: BLE001
            await self.close()
            raise ConnectionError(f"no OpenAI-compatible server answers at {self.target}/v1/models: {exc}") from exc
        if self.model is None:
            if not models:
                raise ConnectionError(f"{self.target}/v1/models lists no model; name one with --model")
            self.model = models[0]["id"]
        served = next((m for m in models if m.get("id") == self.model), {})
        return str((served.get("decoding") or {}).get("mode", ""))  # MineDraft's extra field

    def _body(self, request: BenchRequest, sampling: Sampling, seed: int | None) -> dict[str, Any]:
        max_tokens = request.output_len or sampling.max_tokens
        body: dict[str, Any] = {
            "model": self.model, "temperature": sampling.temperature, "top_p": sampling.top_p, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        if self.chat:
            body.update(messages=[{"role": "user", "content": request.prompt}], max_completion_tokens=max_tokens)
        else:
            body.update(prompt=request.prompt, max_tokens=max_tokens)
        # vLLM's extras: only when asked, so that a strict OpenAI server sees plain bodies
        extras = {"seed": seed, "stop": list(sampling.stop) if sampling.stop else None,
                  "top_k": sampling.top_k if sampling.top_k != -1 else None, "ignore_eos": sampling.ignore_eos or None}
        return body | {k: v for k, v in extras.items() if v is not None}  # fmt: skip

    async def send(
        self, request: BenchRequest, sampling: Sampling, seed: int | None, record: RequestRecord, start: float
    ) -> None:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        async with self._session.post(self.target + path, json=self._body(request, sampling, seed)) as reply:
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:300]}")
            async for line in reply.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                self._on_event(json.loads(payload), time.perf_counter() - start, record)
        if not record.completion_tokens:  # no usage from the server
            tokens = len(self.tokenizer.encode(record.text, add_special_tokens=False)) if self.tokenizer else None
            record.completion_tokens = tokens if tokens is not None else len(record.chunk_times)

    def _on_event(self, event: dict[str, Any], since_send: float, record: RequestRecord) -> None:
        if "error" in event:  # a failure mid-stream, sent as an event
            raise RuntimeError(f"server error mid-stream: {event['error'].get('message', event['error'])}")
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            text = (delta.get("content") if self.chat else choice.get("text")) or ""
            # An empty chunk mid-stream still brings tokens (a server holds back the bytes of an incomplete
            # character); an empty closing chunk or a chat stream's role announcement brings none.
            if text or not (choice.get("finish_reason") or "role" in delta):
                record.on_chunk(since_send, text, None)
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        if usage := event.get("usage"):
            record.prompt_tokens = usage.get("prompt_tokens") or record.prompt_tokens
            record.completion_tokens = usage.get("completion_tokens") or 0
        if stats := (event.get("metrics") or {}).get("speculative_decoding"):  # --per-request-spec-decode-metrics
            read_spec_decode_metrics(stats, record)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def read_spec_decode_metrics(stats: dict[str, Any], record: RequestRecord) -> None:
    """A response's `metrics.speculative_decoding` into `record`, in our names or vLLM's (whose summary has
    an acceptance histogram: index j counts the verifications that accepted exactly j draft tokens, so
    position i was accepted in those that accepted more than i)."""
    record.num_drafts = int(stats.get("num_drafts", stats.get("num_spec_steps", 0)))
    record.num_draft_tokens = int(stats.get("num_draft_tokens", 0))
    record.num_accepted_tokens = int(stats.get("num_accepted_tokens", stats.get("num_accepted_draft_tokens", 0)))
    per_pos = stats.get("num_accepted_tokens_per_pos")
    if not per_pos and (histogram := stats.get("acceptance_histogram")):
        per_pos = [sum(histogram[i + 1:]) for i in range(len(histogram) - 1)]
    record.accepted_per_pos = [int(n) for n in per_pos or []]


def make_backend(
    name: str, target: str, *, timeout: float | None, model: str | None = None, api_key: str | None = None,
    tokenizer: Any = None,
) -> Backend:  # fmt: skip
    if name == "minedraft-grpc":
        return GrpcBackend(target, timeout)
    if name in ("openai", "openai-chat"):
        return OpenAIBackend(target, name == "openai-chat", timeout, model, api_key, tokenizer)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
