"""The lookup workloads of the served benchmark: prompts whose answers repeat text the request holds (code to edit,
a passage to quote), sent to every server by one client that can attach OpenAI's predicted output.

`vllm bench serve` cannot send a request's `prediction`, so these runs go through `minedraft bench`'s own OpenAI
backend (aiohttp, server-sent events, the same TTFT, TPOT and ITL definitions as vLLM's client: records.py),
with each request's `prediction` ({"type": "content", "content": ...}) added for the servers that take it, and
`usage.completion_tokens_details.accepted_prediction_tokens` / `rejected_prediction_tokens` read from the
stream's usage chunk where a server reports them. A run's result carries vLLM's result keys (`output_throughput`,
`median_tpot_ms`, ...), so the sweep's tables read it as they read vLLM's client's.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minedraft.bench.backends import OpenAIBackend, Sampling
from minedraft.bench.online import _dispatch
from minedraft.bench.prompts import BenchRequest
from minedraft.bench.records import BenchResult, RequestRecord
from minedraft.config import BUNDLED_MODELS_DIR

WORKLOADS = {"code-edit": BUNDLED_MODELS_DIR / "prompts" / "code-edit.jsonl",
             "quote-context": BUNDLED_MODELS_DIR / "prompts" / "quote-context.jsonl"}  # fmt: skip
ANSWER_MARGIN = 64  # tokens a request may take past its expected answer (code fences, a sentence around it)
PREDICTED = "+prediction"  # a server named NAME+prediction is sent each request's prediction


@dataclass(frozen=True)
class LookupRequest(BenchRequest):
    """A request of a lookup workload: its prompt as sent (rendered with the chat template where the model has
    one), its max_tokens (`output_len`) and the text a client would predict the answer holds."""

    prediction: str | None = None


def load_workload(name: str | Path, *, template: Any = None, tokenizer: Any = None, max_tokens: int = 512,
                  limit: int | None = None) -> list[LookupRequest]:  # fmt: skip
    """The workload `name` (of WORKLOADS, or a JSON-lines file of {"prompt", "prediction"?, "answer"?}) as
    requests: each prompt rendered by `template` as one user turn (a frontends.chat.ChatTemplate; None: as is),
    asking for its expected answer's tokens (the line's `answer`, else its `prediction`) plus ANSWER_MARGIN, at
    most `max_tokens` (all of `max_tokens` without a tokenizer or an expected answer)."""
    path = WORKLOADS.get(str(name), Path(name))
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    requests = []
    for row in rows[:limit] if limit else rows:
        prompt = row["prompt"]
        if template is not None:
            prompt = template.render([{"role": "user", "content": prompt}])
        expected = row.get("answer") or row.get("prediction")
        wants = max_tokens
        if tokenizer is not None and expected:
            wants = min(max_tokens, len(tokenizer.encode(expected, add_special_tokens=False)) + ANSWER_MARGIN)
        requests.append(LookupRequest(prompt, output_len=wants, prediction=row.get("prediction")))
    return requests


Windows = dict[tuple[int, int], list[int]]  # (round, load's place) -> the indices of the prompts its runs send


def windows(total: int, sizes: list[int], rounds: int, warm_up: int) -> tuple[list[int], Windows]:
    """Which prompts (indices) each run takes: the first `warm_up` for the warm-up, then, round by round and load
    by load (`sizes[j]` prompts at the j-th load), the next ones, wrapping around past the warm-up's at `total`.
    Every server runs the same prompts at the same (round, load); successive runs take new ones, so that a server
    that remembers past outputs (suffix decoding's global tree) meets a prompt again only once the file is used up."""
    if warm_up < 0 or warm_up >= total:
        raise ValueError(f"{total} prompts leave none past a warm-up of {warm_up}")
    spans, offset = {}, 0
    for round_index in range(rounds):
        for j, size in enumerate(sizes):
            spans[round_index, j] = [warm_up + (offset + i) % (total - warm_up) for i in range(size)]
            offset += size
    return list(range(warm_up)), spans


class PredictionBackend(OpenAIBackend):
    """OpenAI's completions (or chat) API with each request's `prediction` attached when `send_prediction`, and
    the accepted / rejected prediction tokens of each response's usage kept by request index."""

    def __init__(self, base_url: str, *, send_prediction: bool, chat: bool = False, timeout: float | None = 600.0,
                 model: str | None = None) -> None:  # fmt: skip
        super().__init__(base_url, chat, timeout, model)
        self.send_prediction = send_prediction
        self.prediction_tokens: dict[int, tuple[int | None, int | None]] = {}

    def _body(self, request: BenchRequest, sampling: Sampling, seed: int | None) -> dict[str, Any]:
        body = super()._body(request, sampling, seed)
        prediction = getattr(request, "prediction", None)
        if self.send_prediction and prediction:
            body["prediction"] = {"type": "content", "content": prediction}
        return body

    def _on_event(self, event: dict[str, Any], since_send: float, record: RequestRecord) -> None:
        super()._on_event(event, since_send, record)
        details = (event.get("usage") or {}).get("completion_tokens_details") or {}
        accepted, rejected = details.get("accepted_prediction_tokens"), details.get("rejected_prediction_tokens")
        if accepted is not None or rejected is not None:
            self.prediction_tokens[record.index] = (accepted, rejected)


async def run_async(base_url: str, requests: list[LookupRequest], *, concurrency: int, send_prediction: bool,
                    ignore_eos: bool = False, model: str | None = None, timeout: float | None = 600.0,
                    ) -> dict:  # fmt: skip
    """Every request streamed greedily to `base_url`, `concurrency` at a time; the run's result (see `result`)."""
    backend = PredictionBackend(base_url, send_prediction=send_prediction, timeout=timeout, model=model)
    sampling = Sampling(max(r.output_len or 1 for r in requests), 0.0, ignore_eos=ignore_eos)
    await backend.open()
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        records = await _dispatch(backend, requests, sampling, concurrency, [0.0] * len(requests), None, False)
        duration = loop.time() - start
    finally:
        await backend.close()
    run = BenchResult(backend.target, concurrency, None, sampling.max_tokens, 0.0, duration, records,
                      backend="openai", percentiles=(50.0, 99.0))  # fmt: skip
    return result(run, [backend.prediction_tokens.get(r.index) for r in records])


def run(base_url: str, requests: list[LookupRequest], **options: Any) -> dict:
    return asyncio.run(run_async(base_url, requests, **options))


def _ms(value: float) -> float | None:
    return None if math.isnan(value) else value * 1e3


def result(run: BenchResult, prediction_tokens: list[tuple[int | None, int | None] | None]) -> dict:
    """A run as vLLM's result keys (those the sweep's tables read), the texts, each request's output tokens and
    its accepted / rejected prediction tokens (None where the server reported none), and the first error."""
    return {
        "completed": len(run.ok), "failed": run.failed, "first_error": run.first_error, "duration": run.duration_s,
        "total_input_tokens": run.input_tokens, "total_output_tokens": run.output_tokens,
        "output_throughput": run.output_throughput, "request_throughput": run.request_throughput,
        "median_ttft_ms": _ms(run.ttft.median), "p99_ttft_ms": _ms(run.ttft.percentiles[99.0]),
        "median_tpot_ms": _ms(run.tpot.median), "median_itl_ms": _ms(run.itl.median),
        "median_e2el_ms": _ms(run.e2el.median),
        "generated_texts": [r.text for r in run.records], "output_lens": [r.output_tokens for r in run.records],
        "accepted_prediction_tokens": [None if p is None else p[0] for p in prediction_tokens],
        "rejected_prediction_tokens": [None if p is None else p[1] for p in prediction_tokens],
    }  # fmt: skip
