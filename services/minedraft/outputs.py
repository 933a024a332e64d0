"""Results of the offline API, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from minedraft.engine.request import Request, SpecDecodeStats


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" (| "abort", or "error": failed alone)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec_decode_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    metrics: RequestMetrics | None = None

    @classmethod
    def from_request(cls, request: Request) -> RequestOutput:
        return cls(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_ids,
            outputs=[CompletionOutput(0, request.text, list(request.output_ids), request.finish_reason)],
            finished=request.finished,
            spec_decode_stats=request.stats,
            metrics=RequestMetrics(request.arrival_time, request.first_token_time, request.finish_time),
        )
