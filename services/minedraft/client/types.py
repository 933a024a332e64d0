"""Plain result types of the client SDK, decoupled from the generated protobuf classes."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import grpc

from minedraft.api import generate_pb2 as pb


class MineDraftError(grpc.RpcError):
    """A failed call: the server's (or the deadline's) status code and details.

    Both clients raise this one type; the underlying grpc error, when there is one, is `__cause__`.
    """

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[tuple[str, str | bytes], ...] = ()
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._trailing_metadata = trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._trailing_metadata

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> MineDraftError:
        """Wrap a grpc error (sync `grpc.Call` or `grpc.aio.AioRpcError`); keeps code, details, trailers."""
        if isinstance(err, MineDraftError):
            return err
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
        return cls(code, details or "", tuple(trailers or ()))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # With a prediction (OpenAI's counts): output tokens that were the prediction's next token, and the prediction's
    # other tokens. None without one.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative-decoding counters of one request (all zero without speculative decoding)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: the accepted drafts plus the target's own token."""
        if self.num_drafts == 0:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the target, and the most likely tokens' (best first)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int | None = None  # the token's rank under the target (1: most likely); prompt logprobs only


@dataclass(frozen=True)
class Delta:
    """One streamed message: the new text and token ids since the previous delta.

    `text` may be empty while `token_ids` is not: the server holds back bytes of an incomplete
    UTF-8 character until the token that completes it arrives. `finish_reason`, `usage` and
    `spec_decode_stats` are set on the last delta only (None on the others).
    """

    text: str
    token_ids: list[int]
    request_id: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    spec_decode_stats: SpecDecodeStats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the call asked for `logprobs`
    # When the call asked for `prompt_logprobs`: one per prompt token after the first, on the first delta with tokens.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Completion:
    """A finished generation: the concatenation of a stream's deltas."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    usage: Usage
    spec_decode_stats: SpecDecodeStats
    request_id: str = ""
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the call asked for `logprobs`
    # When the call asked for `prompt_logprobs`: one per prompt token after the first (the first has none).
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class DrafterPoolMember:
    address: str
    serving: bool
    groups: int  # groups bound to it
    capacity: int  # groups it may serve
    queue: int  # draft parts waiting for its model


@dataclass(frozen=True)
class DrafterPoolInfo:
    bound: str  # the member the group drafts with; "" while it decodes target-only
    members: tuple[DrafterPoolMember, ...]
    rebinds: int
    queue: int  # other groups' draft parts waiting at the bound member, as of the group's last step

    @classmethod
    def from_proto(cls, msg: pb.DrafterPoolInfo) -> DrafterPoolInfo:
        members = tuple(DrafterPoolMember(m.address, m.serving, m.groups, m.capacity, m.queue) for m in msg.members)
        return cls(msg.bound, members, msg.rebinds, msg.queue)


@dataclass(frozen=True)
class ServerInfo:
    """The `GetServerInfo` answer (see proto/minedraft/v1/generate.proto for the field meanings)."""

    version: str = ""
    target_model: str = ""
    draft_model: str = ""  # empty without speculative decoding
    mode: str = ""  # ar | sd | pearl | minedraft
    speculative_config_json: str = ""
    tensor_parallel_size: int = 0
    max_num_seqs: int = 0
    max_model_len: int = 0
    max_waiting_requests: int = 0
    vocab_size: int = 0
    num_kv_blocks: int = 0  # KV-cache blocks the server admits requests by
    kv_block_size: int = 0  # tokens per block
    max_num_batched_tokens: int = 0  # a step's token budget; longer prompts are prefilled in chunks
    draft_method: str = ""  # draft_model | pard | eagle | eagle3 | p-eagle; empty for ar
    enable_prefix_caching: bool = False  # workers reuse the KV blocks of prompts they have seen
    quantization: str = ""  # how the target checkpoint stores its weights, e.g. "fp8 (blocks 128x128)"; "": floats
    draft_quantization: str = ""  # the same for the draft checkpoint
    # Adaptive speculation as of the last second: shapes chosen, acceptance, fitted costs (JSON); "": fixed or off
    speculation_json: str = ""
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters served, by name (generate's `lora`)
    # With a drafter pool: the member the group drafts with ("" while target-only), every member's load as the
    # group last looked (about every second), the group's rebinds; None without a pool.
    drafter_pool: DrafterPoolInfo | None = None

    @property
    def speculation(self) -> dict[str, Any]:
        """What adaptive speculation measured and chose (see speculation_json); empty when fixed or off."""
        return json.loads(self.speculation_json) if self.speculation_json else {}

    @property
    def speculative_config(self) -> dict[str, Any]:
        """The active speculative config as a dict; empty for plain autoregressive serving."""
        return json.loads(self.speculative_config_json) if self.speculative_config_json else {}

    @classmethod
    def from_proto(cls, msg: pb.ServerInfo) -> ServerInfo:
        """Field by field: the proto's ServerInfo and this class have the same fields by name."""
        values = {f.name: getattr(msg, f.name) for f in fields(cls)}
        values["lora_adapters"] = tuple(msg.lora_adapters)
        values["drafter_pool"] = DrafterPoolInfo.from_proto(msg.drafter_pool) if msg.HasField("drafter_pool") else None
        return cls(**values)
