"""What the public frontends need of an engine, and what comes back to them.

The frontends (gRPC and OpenAI HTTP) depend on this interface, not on the step loop that implements it
(`scheduler/loop.EngineLoop`), as vLLM's OpenAI server depends on its `EngineClient`: a request is
submitted with a `Sink`, its outputs arrive there as `StreamItem`s on the frontend's event loop, and an
engine-side failure arrives as an exception instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from minedraft.config import LoraModule
from minedraft.engine.request import Request
from minedraft.sampling.params import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from minedraft.api.generate_pb2 import DrafterPoolInfo, ServerInfo


@dataclass
class StreamItem:
    """New output of one request since the previous item; `request` is set on the last one."""

    text: str
    token_ids: list[int]
    finished: Request | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first item with tokens, when the request asked


@dataclass
class Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent_tokens: int = 0
    last_output_at: float | None = None  # time.monotonic() of the last step that gave this request tokens
    on_start: Callable[[], None] | None = None  # run on the event loop once the request leaves the waiting queue

    def put(self, item: StreamItem | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def started(self) -> None:
        if self.on_start is not None:
            self.loop.call_soon_threadsafe(self.on_start)


def send_all(outbox: list[tuple[Sink, StreamItem | BaseException]]) -> None:
    """A step's outputs with one wake-up of each event loop, not one per request: every wake-up is a write
    to the loop's self-pipe and a turn of the loop, under the GIL that the step thread needs too."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamItem | BaseException]]] = {}
    for sink, item in outbox:
        by_loop.setdefault(sink.loop, []).append((sink.queue, item))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, StreamItem | BaseException]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


class EngineFailed(RuntimeError):
    """The engine group cannot run requests now (its verifier is gone); they fail with UNAVAILABLE."""


class RequestFailed(RuntimeError):
    """This request, and no other, could not be run (see `EngineLoop._convict`)."""


class EngineClient(Protocol):
    """An engine the frontends can submit to. `failed` is why it cannot run requests now (None: it can);
    `speculation` what adaptive speculation measured and chose, as of the last second (None: not known here);
    `lora_adapters` the names of the LoRA adapters a request may run through (None: not known here, the engine
    behind checks them)."""

    failed: str | None
    speculation: dict | None
    lora_adapters: list[str] | None

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_pool(self) -> tuple[int, int] | None:
        """(blocks, tokens per block) of the workers' KV pool; None where it is not known."""

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError naming the field if the engine cannot honour the request."""

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, prompt: str | None,
               sink: Sink, lora: str | None = None, deadline: float | None = None) -> None:  # fmt: skip
        """Queue a request, through LoRA adapter `lora` (one of `lora_adapters`; None: the base model).
        `deadline`: the time.monotonic() until which its client waits (None: no deadline)."""

    def abort(self, request_id: str) -> None: ...

    async def load_lora(self, module: LoraModule) -> None:
        """Serve one more LoRA adapter, loaded on every worker (of every group); raises engine.LoraRefused."""

    async def unload_lora(self, name: str) -> None:
        """Stop serving an adapter once the requests running through it have finished; raises LoraRefused."""

    async def server_info(self, timeout: float | None) -> ServerInfo:
        """What GetServerInfo answers, within `timeout` seconds (None: the engine's own bound); raises
        `frontends.generate.GenerateError` when it cannot be told."""

    async def drafter_pools(self, timeout: float | None) -> dict[str, DrafterPoolInfo | None]:
        """Each engine group's drafter pool binding (a DrafterPoolInfo, None without a pool), by the group's
        address ("" for the group this process is)."""
