"""The one generate interface both public frontends (gRPC and OpenAI HTTP) use over an engine client.

It owns what must hold for every protocol: input limits checked before any tokenizing, admission
counted here, synchronously on the event loop (the step loop's own counters lag by a step), client
request ids unique while in flight, and the conversion of engine failures to protocol-neutral errors.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from minedraft.engine.request import Request
from minedraft.engine_client import EngineClient, EngineFailed, RequestFailed, Sink, StreamItem
from minedraft.model.tokenizer import Tokenizer
from minedraft.sampling.params import SamplingParams, check_unicode
from minedraft.settings import PublicApiSettings


class ErrorKind(enum.Enum):
    """Why a request was refused or failed; each frontend maps it to its protocol's status."""

    INVALID = "invalid_argument"  # the client's input is wrong
    DUPLICATE = "already_exists"  # its request id is in flight already
    BUSY = "resource_exhausted"  # the waiting queue is full: retry later
    UNAVAILABLE = "unavailable"  # starting, or the engine group failed
    INTERNAL = "internal"


class GenerateError(Exception):
    """`grpc_status`: the name of the gRPC status a remote engine refused the request with (the gateway's
    groups), which the gRPC frontend passes on as it came; None: the kind's own."""

    def __init__(self, kind: ErrorKind, message: str, grpc_status: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.grpc_status = grpc_status


_DEFAULTS = PublicApiSettings()


@dataclass(frozen=True)
class Limits:
    """The public APIs' input limits; their defaults are the settings' (the settings model is their source)."""

    max_prompt_bytes: int = _DEFAULTS.max_prompt_bytes
    max_waiting: int = _DEFAULTS.max_waiting_requests

    @classmethod
    def of(cls, settings: PublicApiSettings) -> Limits:
        return cls(max_prompt_bytes=settings.max_prompt_bytes, max_waiting=settings.max_waiting_requests)


class Generator:
    """Validates, admits and streams requests; `engine` is set once the workers are ready."""

    def __init__(self, tokenizer: Tokenizer, limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.engine: EngineClient | None = None
        self.num_waiting = 0  # admitted here and not yet in a batch
        self._client_ids: set[str] = set()

    def check_ready(self) -> EngineClient:
        if self.engine is None:
            raise GenerateError(ErrorKind.UNAVAILABLE, "server is starting: the workers are not ready yet")
        if self.engine.failed is not None:
            raise GenerateError(ErrorKind.UNAVAILABLE, self.engine.failed)
        return self.engine

    @property
    def max_model_len(self) -> int:
        return self.check_ready().max_model_len

    async def start(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        add_special_tokens: bool = True,
        fit_context: bool = False,
        lora: str | None = None,
        deadline: float | None = None,
    ) -> Generation:
        """Admit one request; raises GenerateError if it is refused. The caller must close the result.

        `add_special_tokens=False` for a rendered chat template, which holds its special tokens already
        (as Hugging Face tokenizes it). `fit_context`: refuse a request whose prompt and max_tokens together
        exceed the context (OpenAI's rule) instead of stopping it at the context's end. `lora`: the LoRA
        adapter it runs through (None: the base model). `deadline`: the client's, as time.monotonic()."""
        engine = self.check_ready()
        self.check_prompt_size(prompt)
        _check_lora(engine, lora)
        if request_id and request_id in self._client_ids:
            raise GenerateError(
                ErrorKind.DUPLICATE, f"request_id {request_id!r} is already in flight; ids must be unique while running"
            )
        if self.num_waiting >= self.limits.max_waiting:
            raise GenerateError(
                ErrorKind.BUSY,
                f"server is at capacity: {self.num_waiting} requests are waiting (max_waiting_requests="
                f"{self.limits.max_waiting}); retry later",
            )
        # Reserve before the first await, so that concurrent requests see each other.
        generation = Generation(self, request_id or uuid.uuid4().hex, bool(request_id))
        try:
            prompt_ids = await self.prompt_ids(prompt, add_special_tokens)
            self._check_request(engine, prompt_ids, params)
            if fit_context:
                _check_context_length(engine.max_model_len, len(prompt_ids), params.max_tokens)
            engine.submit(generation.internal_id, prompt_ids, params, prompt if isinstance(prompt, str) else None,
                          generation.sink, lora=lora, deadline=deadline)  # fmt: skip
        except BaseException:
            generation.release()
            raise
        generation.prompt_ids = prompt_ids
        return generation

    def check_prompt_size(self, prompt: str | Sequence[int]) -> None:
        """Before tokenizing: a huge text costs seconds of CPU. (Token ids are bounded by max_model_len.)"""
        if not isinstance(prompt, str):
            return
        size = len(prompt.encode("utf-8", "surrogatepass"))
        if size > self.limits.max_prompt_bytes:
            raise GenerateError(
                ErrorKind.INVALID,
                f"prompt is {size} bytes, more than this server accepts ({self.limits.max_prompt_bytes}, "
                "--max-prompt-bytes)",
            )
        try:
            check_unicode(prompt)
        except ValueError as exc:
            raise GenerateError(ErrorKind.INVALID, f"prompt: {exc}") from None

    async def prompt_ids(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if not prompt:
            return []
        # In a thread, without the GIL: a long prompt must not stall the other streams or the step loop.
        return await asyncio.to_thread(self.tokenizer.encode_concurrently, prompt, add_special_tokens)

    @staticmethod
    def _check_request(engine: EngineClient, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's own checks, here and now: a refused request never gets as far as a stream."""
        try:
            engine.check_request(prompt_ids, params)
        except ValueError as exc:
            raise GenerateError(ErrorKind.INVALID, str(exc)) from None


def _check_lora(engine: EngineClient, name: str | None) -> None:
    if name is not None and engine.lora_adapters is not None and name not in engine.lora_adapters:
        served = ", ".join(engine.lora_adapters) or "none"
        raise GenerateError(ErrorKind.INVALID, f"unknown LoRA adapter {name!r}: this server has {served}")


def _check_context_length(max_model_len: int, num_prompt: int, max_tokens: int) -> None:
    if num_prompt + max_tokens > max_model_len:
        raise GenerateError(
            ErrorKind.INVALID,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the completion "
            f"(max_tokens)). Please reduce the length of the prompt or max_tokens.",
        )


class Generation:
    """One admitted request: an async iterator of StreamItems (the last has `finished` set).

    Use it as `async with generation:` so that a request whose client went away is aborted (its KV freed
    on both workers) and its bookkeeping released.
    """

    def __init__(self, owner: Generator, request_id: str, client_chose_id: bool) -> None:
        self.owner = owner
        self.request_id = request_id
        self.internal_id = uuid.uuid4().hex  # the engine's id: unique even if a client reuses its own
        self.prompt_ids: list[int] = []
        self.sink = Sink(asyncio.get_running_loop(), on_start=self._left_queue)
        self.finished: Request | None = None
        self._pending: BaseException | None = None  # an error read while joining deltas, raised next
        self._waiting = True
        self._client_id = request_id if client_chose_id else None
        owner.num_waiting += 1
        if self._client_id:
            owner._client_ids.add(self._client_id)

    def _left_queue(self) -> None:
        if self._waiting:
            self._waiting = False
            self.owner.num_waiting -= 1

    def release(self) -> None:
        """Give back the admission slot and the client id (idempotent)."""
        self._left_queue()
        if self._client_id:
            self.owner._client_ids.discard(self._client_id)
            self._client_id = None

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> StreamItem:
        if self.finished is not None:
            raise StopAsyncIteration
        item = self._pending or await self.sink.queue.get()
        self._pending = None
        item = self._merge_ready(item)
        if isinstance(item, BaseException):
            self.release()
            raise _as_generate_error(item)
        if item.finished is not None:
            self.finished = item.finished
            self.release()
        return item

    def _merge_ready(self, item: StreamItem | BaseException) -> StreamItem | BaseException:
        """Join the deltas that are already queued into one: a client that reads slower than the engine
        steps gets fewer, larger messages instead of a growing backlog (an error is kept for the next read)."""
        queue = self.sink.queue
        while isinstance(item, StreamItem) and item.finished is None and not queue.empty():
            later = queue.get_nowait()
            if isinstance(later, BaseException):
                self._pending = later
                break
            logprobs = None if item.logprobs is None else item.logprobs + (later.logprobs or [])
            item = StreamItem(item.text + later.text, item.token_ids + later.token_ids, later.finished, logprobs,
                              later.prompt_logprobs if item.prompt_logprobs is None else item.prompt_logprobs)
        return item

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self.finished is None and self.owner.engine is not None:
            self.owner.engine.abort(self.internal_id)  # cancelled, expired or failed: free its KV
        self.release()


def _as_generate_error(exc: BaseException) -> GenerateError:
    if isinstance(exc, GenerateError):  # an engine client that knows the kind already (the gateway's)
        return exc
    if isinstance(exc, ValueError):
        return GenerateError(ErrorKind.INVALID, str(exc))
    if isinstance(exc, EngineFailed):
        return GenerateError(ErrorKind.UNAVAILABLE, str(exc))
    if isinstance(exc, RequestFailed):
        return GenerateError(ErrorKind.INTERNAL, str(exc))
    return GenerateError(ErrorKind.INTERNAL, f"generation failed: {exc}")
