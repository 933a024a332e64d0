"""Results of the offline API, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from minedraft.engine.request import Request, SpecDecodeStats
from minedraft.sampling.params import TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" (| "abort", or "error": failed alone)
    # Per output token, when SamplingParams.logprobs asked: {token id: logprob} of the token and the top ones.
    logprobs: list[dict[int, float]] | None = None


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
    # When SamplingParams.prompt_logprobs asked: per prompt token, {token id: logprob} of it and the top ones
    # given the tokens before it; None for the first token (nothing precedes it).
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @classmethod
    def from_request(cls, request: Request) -> RequestOutput:
        return cls(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_ids,
            outputs=[CompletionOutput(0, request.text, list(request.output_ids), request.finish_reason,
                                      _logprob_dicts(request))],  # fmt: skip
            finished=request.finished,
            spec_decode_stats=request.stats,
            metrics=RequestMetrics(request.arrival_time, request.first_token_time, request.finish_time),
            prompt_logprobs=_prompt_logprob_dicts(request),
        )


def _logprob_dicts(request: Request) -> list[dict[int, float]] | None:
    if request.logprobs is None:
        return None
    return logprob_dicts(request.output_ids, request.logprobs)


def _prompt_logprob_dicts(request: Request) -> list[dict[int, float] | None] | None:
    if request.prompt_logprobs is None:
        return None
    return [None, *logprob_dicts(request.prompt_ids[1:], request.prompt_logprobs)]


def logprob_dicts(token_ids: list[int], logprobs: list[TokenLogprob]) -> list[dict[int, float]]:
    """{token id: logprob} of each token and its top ones (the token first)."""
    return [{token: lp.logprob, **dict(zip(lp.top_ids, lp.top_logprobs))} for token, lp in zip(token_ids, logprobs)]
