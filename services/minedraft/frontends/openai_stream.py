"""The OpenAI-compatible API's responses: chunks and final bodies built from the generate interface's items.

Streams are server-sent events ending with `data: [DONE]`; a failure mid-stream is an error event in
OpenAI's shape before it. `CompletionStream` and `ChatStream` build each endpoint's chunks; `respond` and
`respond_best` (best_of) turn a request's generations into the HTTP response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from minedraft.engine.request import Request as EngineRequest
from minedraft.engine.request import SpecDecodeStats
from minedraft.engine_client import StreamItem
from minedraft.frontends.generate import GenerateError, Generation
from minedraft.frontends.openai_protocol import STATUS, error_body
from minedraft.frontends.tools import ToolUse, new_call_id
from minedraft.model.tokenizer import Tokenizer
from minedraft.sampling.params import TokenLogprob

Logprobs = list[tuple[int, TokenLogprob]] | None  # (token id, its logprobs) per output token


def _vllm_spec_counts(stats: SpecDecodeStats) -> dict:
    """vLLM's names for the same counts, and its acceptance histogram (index j: the verifications that
    accepted exactly j draft tokens). Acceptance stops at the first rejection, so position i was accepted in
    the verifications that accepted more than i tokens, whatever k each one drafted."""
    at_least = [stats.num_drafts, *stats.num_accepted_tokens_per_pos, 0]  # verifications accepting >= j
    rate = stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.0
    return {"num_spec_steps": stats.num_drafts, "num_accepted_draft_tokens": stats.num_accepted_tokens,
            "draft_acceptance_rate": rate, "acceptance_histogram": [a - b for a, b in zip(at_least, at_least[1:])]}


class Stream:
    """Builds one endpoint's chunks and final body from the generate interface's items; choice `index` i is
    the i-th generation of the request (prompt by prompt, `n` samples each)."""

    object_full: str
    object_chunk: str
    spec_decode_metrics: str | None = None  # 'summary' or 'detailed': responses carry the requests' drafts

    def metrics(self, body: dict, finished: list[EngineRequest]) -> dict:
        """`body` with the finished requests' speculative decoding counts (`metrics.speculative_decoding`), if
        asked."""
        if self.spec_decode_metrics is None:
            return body
        stats = SpecDecodeStats()
        for request in finished:
            stats.merge(request.stats)
        counts = {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                  "num_accepted_tokens": stats.num_accepted_tokens,
                  "mean_acceptance_length": stats.mean_accepted_length} | _vllm_spec_counts(stats)  # fmt: skip
        if self.spec_decode_metrics == "detailed":
            counts["num_accepted_tokens_per_pos"] = list(stats.num_accepted_tokens_per_pos)
        return body | {"metrics": {"speculative_decoding": counts}}

    def __init__(self, response_id: str, model: str, include_usage: bool, tokenizer: Tokenizer | None = None) -> None:
        self.id, self.model, self.include_usage = response_id, model, include_usage
        self.tokenizer = tokenizer  # renders the tokens of logprobs
        self.created = int(time.time())

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else str(token_id)

    def _envelope(self, obj: str, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or (obj == self.object_chunk and self.include_usage):
            body["usage"] = usage
        return body

    def chunk(self, text: str, finish_reason: str | None, logprobs: Logprobs = None, index: int = 0) -> dict:
        raise NotImplementedError

    def first_chunks(self, index: int = 0) -> list[dict]:
        return []

    def choice(self, index: int, text: str, finish_reason: str, logprobs: Logprobs = None) -> dict:
        raise NotImplementedError

    def full(self, choices: list[dict], usage: dict) -> dict:
        return self._envelope(self.object_full, choices, usage)

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope(self.object_chunk, [], usage)


class CompletionStream(Stream):
    object_full = object_chunk = "text_completion"

    def __init__(self, *args, echo: list[str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo  # per choice, the prompt text its output follows (`echo`)
        self._offsets: dict[int, int] = {}  # per choice, the text_offset of its next token

    def first_chunks(self, index: int = 0) -> list[dict]:
        return [self.chunk("", None, None, index)] if self.echo else []

    def chunk(self, text: str, finish_reason: str | None, logprobs: Logprobs = None, index: int = 0) -> dict:
        if self.echo and index not in self._offsets:
            text = self.echo[index] + text
        choice = {"index": index, "text": text, "logprobs": self._logprobs(logprobs, index),
                  "finish_reason": finish_reason}  # fmt: skip
        self._offsets.setdefault(index, 0)
        return self._envelope(self.object_chunk, [choice])

    def choice(self, index: int, text: str, finish_reason: str, logprobs: Logprobs = None) -> dict:
        echoed = self.echo[index] if self.echo else ""
        return {"index": index, "text": echoed + text, "logprobs": self._logprobs(logprobs, index),
                "finish_reason": finish_reason}  # fmt: skip

    def prompt_logprobs(self, prompt_ids: list[int], logprobs: list[TokenLogprob]) -> list[dict | None]:
        """vLLM's shape: per prompt token, None for the first, then {token id: {logprob, rank, decoded_token}} of
        the token and the top ones (ranks 1.. in order; the prompt token's own rank when it is not among them)."""
        rendered: list[dict | None] = [None]
        for token, lp in zip(prompt_ids[1:], logprobs):
            entry = {str(token): self._ranked(token, lp.logprob, lp.rank)}
            entry.update({str(t): self._ranked(t, v, rank) for rank, (t, v) in enumerate(zip(lp.top_ids,
                          lp.top_logprobs), start=1) if t != token})  # fmt: skip
            rendered.append(entry)
        return rendered

    def _ranked(self, token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": self._token(token_id)}

    def _logprobs(self, logprobs: Logprobs, index: int) -> dict | None:
        """The legacy completions shape: tokens, their logprobs, {token: logprob} of the top ones, offsets."""
        if logprobs is None:
            return None
        tokens = [self._token(t) for t, _ in logprobs]
        start = self._offsets.get(index, 0)
        offsets = [start + sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
        self._offsets[index] = start + sum(len(s) for s in tokens)
        top = [{self._token(t): _finite(lp.logprob), **{self._token(i): _finite(v) for i, v in zip(lp.top_ids,
               lp.top_logprobs)}} for t, lp in logprobs]  # fmt: skip
        return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for _, lp in logprobs], "top_logprobs": top,
                "text_offset": offsets}  # fmt: skip


class ChatStream(Stream):
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args, tools: ToolUse | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # With tool calls to find (auto, required), a streamed choice is held back and sent whole at its finish;
        # a named function's arguments stream as they come.
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self._held: dict[int, tuple[list[str], list]] = {}
        self._call_ids: dict[int, str] = {}

    def first_chunks(self, index: int = 0) -> list[dict]:
        return [self._delta({"role": "assistant", "content": ""}, None, None, index)]

    def chunk(self, text: str, finish_reason: str | None, logprobs: Logprobs = None, index: int = 0) -> dict | None:
        if self.tools is None:
            return self._delta({"content": text} if text else {}, finish_reason, logprobs, index)
        if self.tools.named is not None:
            return self._named_call_chunk(text, finish_reason, logprobs, index)
        texts, held_logprobs = self._held.setdefault(index, ([], []))
        texts.append(text)
        held_logprobs.extend(logprobs or [])
        if finish_reason is None:
            return None
        content, calls = self.tools.parse("".join(texts))
        delta = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(calls)]
        return self._delta(delta, self._finish_reason(finish_reason, calls), held_logprobs or None, index)

    def _named_call_chunk(self, text: str, finish_reason: str | None, logprobs: Logprobs, index: int) -> dict | None:
        """The named function's arguments as they come: its id, type and name with the first piece."""
        if not text:
            return self._delta({}, finish_reason, logprobs, index) if finish_reason or logprobs else None
        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if index not in self._call_ids:
            self._call_ids[index] = new_call_id()
            call.update(id=self._call_ids[index], type="function")
            call["function"] = {"name": self.tools.named.name, "arguments": text}
        return self._delta({"tool_calls": [call]}, finish_reason, logprobs, index)

    def _delta(self, delta: dict, finish_reason: str | None, logprobs: Logprobs, index: int) -> dict:
        return self._envelope(self.object_chunk, [{"index": index, "delta": delta, "logprobs": self._logprobs(logprobs),
                                                   "finish_reason": finish_reason}])  # fmt: skip

    def choice(self, index: int, text: str, finish_reason: str, logprobs: Logprobs = None) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            message["content"], calls = self.tools.parse(text)
            if calls:
                message["tool_calls"] = calls
            finish_reason = self._finish_reason(finish_reason, calls)
        return {"index": index, "message": message, "logprobs": self._logprobs(logprobs),
                "finish_reason": finish_reason}  # fmt: skip

    def _finish_reason(self, finish_reason: str, calls: list) -> str:
        """OpenAI's: tool_calls when the model chose to call (auto, required); a named call stops as text does."""
        chose = calls and self.tools is not None and self.tools.named is None
        return "tool_calls" if chose and finish_reason == "stop" else finish_reason

    def _logprobs(self, logprobs: Logprobs) -> dict | None:
        """Chat's shape: per token its text, logprob and UTF-8 bytes, and the same for the top ones."""
        if logprobs is None:
            return None
        return {"content": [{**self._entry(t, lp.logprob), "top_logprobs": [self._entry(i, v) for i, v in
                             zip(lp.top_ids, lp.top_logprobs)]} for t, lp in logprobs]}  # fmt: skip

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self._token(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token the request's filters drop gets vLLM's floor."""
    return max(logprob, -9999.0)


def _finished(generations: list[Generation]) -> list[EngineRequest]:
    return [g.finished for g in generations]


def _usage(generations: list[Generation], n: int) -> dict:
    """Each prompt counts once, however many samples it had; every sample's output counts."""
    prompt = sum(len(g.prompt_ids) for g in generations[::n])
    completion = sum(len(g.finished.output_ids) for g in generations)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    predicted = [g.finished.prediction_usage for g in generations if g.finished.prediction_usage is not None]
    if predicted:  # OpenAI's Predicted Outputs counts
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": sum(a for a, _ in predicted),
                                              "rejected_prediction_tokens": sum(r for _, r in predicted)}  # fmt: skip
    return usage


async def respond(generations: list[Generation], stream: Stream, streaming: bool, n: int = 1) -> Response:
    if streaming:
        return StreamingResponse(_sse(generations, stream, n), media_type="text/event-stream")
    async with contextlib.AsyncExitStack() as closing:
        for generation in generations:
            await closing.enter_async_context(generation)
        outputs = await asyncio.gather(*(_collect(g) for g in generations))
    choices = [stream.choice(i, "".join(item.text for item in items), g.finished.finish_reason, _item_logprobs(items))
               for i, (g, items) in enumerate(zip(generations, outputs))]  # fmt: skip
    for choice, g, items in zip(choices, generations, outputs):
        _add_prompt_logprobs(stream, choice, g, items)
    return JSONResponse(stream.metrics(stream.full(choices, _usage(generations, n)), _finished(generations)))


async def respond_best(generations: list[Generation], stream: Stream, n: int, samples: int,
                        with_logprobs: bool) -> Response:  # fmt: skip
    """best_of: of each prompt's `samples` generations, the `n` with the highest cumulative logprob of their
    output tokens (best first), as vLLM's; the usage counts every generated token."""
    async with contextlib.AsyncExitStack() as closing:
        for generation in generations:
            await closing.enter_async_context(generation)
        outputs = await asyncio.gather(*(_collect(g) for g in generations))
    ranked = []
    for start in range(0, len(generations), samples):
        group = list(zip(generations[start : start + samples], outputs[start : start + samples]))
        group.sort(key=lambda pair: _cumulative_logprob(pair[1]), reverse=True)
        ranked.extend(group[:n])
    choices = []
    for i, (g, items) in enumerate(ranked):
        logprobs = _item_logprobs(items) if with_logprobs else None
        choices.append(stream.choice(i, "".join(item.text for item in items), g.finished.finish_reason, logprobs))
        _add_prompt_logprobs(stream, choices[-1], g, items)
    return JSONResponse(stream.metrics(stream.full(choices, _usage(generations, samples)), _finished(generations)))


def _cumulative_logprob(items: list[StreamItem]) -> float:
    """The sum of the output tokens' logprobs under the target's processed distribution (`logprobs`)."""
    return math.fsum(lp.logprob for item in items for lp in item.logprobs or [])


async def _collect(generation: Generation) -> list[StreamItem]:
    return [item async for item in generation]


def _add_prompt_logprobs(stream: Stream, choice: dict, generation: Generation, items: list[StreamItem]) -> None:
    """A completion's choice gets its prompt's logprobs where the request asked for them (on the first chunk
    that carries tokens, when streamed)."""
    logprobs = next((item.prompt_logprobs for item in items if item.prompt_logprobs is not None), None)
    if logprobs is not None and isinstance(stream, CompletionStream):
        choice["prompt_logprobs"] = stream.prompt_logprobs(generation.prompt_ids, logprobs)


def _item_logprobs(items: list[StreamItem]) -> Logprobs:
    """(token id, its logprobs) of every token of `items`; None where the request asked for no logprobs."""
    if all(item.logprobs is None for item in items):
        return None
    return [pair for item in items for pair in zip(item.token_ids, item.logprobs or [])]


async def _sse(generations: list[Generation], stream: Stream, n: int) -> AsyncIterator[str]:
    """Chunks as server-sent events, each generation's as they come (choice `index` tells them apart); a
    failure mid-stream is sent as an error event before [DONE]."""
    async with contextlib.AsyncExitStack() as closing:
        for generation in generations:
            await closing.enter_async_context(generation)
        try:
            for index in range(len(generations)):
                for chunk in stream.first_chunks(index):
                    yield _event(chunk)
            async for index, item in _merged(generations):
                finished = item.finished
                chunks = []
                if item.text or finished is None:
                    chunks.append(stream.chunk(item.text, None, _item_logprobs([item]), index))
                if chunks and chunks[0] is not None:
                    _add_prompt_logprobs(stream, chunks[0]["choices"][0], generations[index], [item])
                if finished is not None:  # the choice's last chunk: its drafts, if asked
                    last = stream.chunk("", finished.finish_reason, None, index)
                    chunks.append(last and stream.metrics(last, [finished]))
                for chunk in chunks:
                    if chunk is not None:  # None: held back (a choice whose tool calls are parsed at its finish)
                        yield _event(chunk)
            if stream.include_usage:
                yield _event(stream.metrics(stream.usage_chunk(_usage(generations, n)), _finished(generations)))
        except GenerateError as exc:
            yield _event(error_body(STATUS[exc.kind], exc.message))
    yield "data: [DONE]\n\n"


async def _merged(generations: list[Generation]) -> AsyncIterator[tuple[int, StreamItem]]:
    """(index, item) of every generation, in the order they arrive."""
    if len(generations) == 1:  # the common case, without tasks
        async for item in generations[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for item in generation:
                await queue.put((index, item))
        except GenerateError as exc:
            await queue.put(exc)
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        live = len(tasks)
        while live:
            got = await queue.get()
            if isinstance(got, GenerateError):
                raise got
            if got[1] is None:
                live -= 1
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
