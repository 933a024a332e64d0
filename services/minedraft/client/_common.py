"""What both clients share: request building, response conversion, channel credentials and metadata."""

from __future__ import annotations

import dataclasses
import enum
import json
import operator
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypedDict, Union

import grpc

from minedraft.api import generate_pb2 as pb
from minedraft.client.resume import resume_request
from minedraft.client.retry import DEFAULT_RETRY_POLICY, RetryPolicy
from minedraft.client.types import Completion, Delta, MineDraftError, SpecDecodeStats, TokenLogprob, Usage
from minedraft.version import __version__


class _Unset(enum.Enum):
    UNSET = "UNSET"


UNSET = _Unset.UNSET  # "use the client's default timeout"; None means no deadline
Timeout = Union[float, None, Literal[_Unset.UNSET]]  # noqa: UP007 (Literal of an enum member needs Union)
Prompt = Union[str, Sequence[int]]  # noqa: UP007
Tls = Union[bool, None, grpc.ChannelCredentials, str, os.PathLike]  # noqa: UP007
ChannelOptions = Sequence[tuple[str, Any]]

# The documented server defaults of SamplingParameters. A value equal to its default is left unset so
# the server applies its own default: the wire carries only what the caller chose to change.
_SAMPLING_DEFAULTS: dict[str, object] = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
# Options beyond the call's named arguments, set only when given (None: the server's default).
_OPTIONS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
            "logprobs", "prompt_logprobs", "bad_words", "structured_outputs", "num_speculative_tokens",
            "prediction")  # fmt: skip


class GenerateArguments(TypedDict, total=False):
    """The keyword arguments of `generate` and `stream` (besides `timeout`); see `build_generate_request`."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool
    request_id: str | None
    lora: str | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    logit_bias: Mapping[int, float] | None
    min_p: float | None
    min_tokens: int | None
    logprobs: int | None
    prompt_logprobs: int | None
    bad_words: str | Sequence[str] | None
    structured_outputs: Mapping[str, Any] | None
    num_speculative_tokens: int | None
    prediction: str | None


def build_generate_request(
    prompt: Prompt,
    *,
    max_tokens: int = 16,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    request_id: str | None = None,
    lora: str | None = None,
    **options: Any,
) -> pb.GenerateRequest:
    """The one place both clients turn call arguments into a GenerateRequest. `options`: the other
    SamplingParameters fields by name (presence_penalty, frequency_penalty, repetition_penalty, logit_bias,
    min_p, min_tokens, logprobs, prompt_logprobs, bad_words, structured_outputs, num_speculative_tokens, and
    prediction: the text the output is expected to be, OpenAI's Predicted Outputs); an unknown name is a
    TypeError. `lora`: the LoRA adapter to run through, by name (None: the base model). The defaults are the
    server's (_SAMPLING_DEFAULTS)."""
    request = pb.GenerateRequest(request_id=request_id or "", lora_adapter=lora or "")
    _set_prompt(request, prompt)
    sampling = request.sampling
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if value != _SAMPLING_DEFAULTS[name]:
            setattr(sampling, name, value)
    if seed is not None:
        sampling.seed = seed
    if stop:
        sampling.stop.extend([stop] if isinstance(stop, str) else stop)
    if stop_token_ids:
        sampling.stop_token_ids.extend(operator.index(t) for t in stop_token_ids)
    sampling.ignore_eos = ignore_eos
    _set_options(sampling, options)
    return request


def usage_from_proto(msg: pb.Usage) -> Usage:
    predicted = msg.HasField("accepted_prediction_tokens")
    return Usage(msg.prompt_tokens, msg.completion_tokens,
                 msg.accepted_prediction_tokens if predicted else None,
                 msg.rejected_prediction_tokens if predicted else None)  # fmt: skip


def _set_options(sampling: pb.SamplingParameters, options: dict[str, Any]) -> None:
    for name, value in options.items():
        if name not in _OPTIONS:
            raise TypeError(f"unknown sampling option {name!r}; the options are {', '.join(_OPTIONS)}")
        if value is None:
            continue
        if name == "logit_bias":
            sampling.logit_bias.update({operator.index(t): float(b) for t, b in value.items()})
        elif name == "bad_words":
            sampling.bad_words.extend([value] if isinstance(value, str) else value)
        elif name == "structured_outputs":
            _set_structured(sampling.structured_outputs, value)
        else:
            setattr(sampling, name, value)


def _set_structured(msg: pb.StructuredOutputs, value: dict[str, Any]) -> None:
    """{"json": schema (a dict or its text)} or {"regex": ...}, {"choice": [...]}, {"json_object": True}."""
    msg.SetInParent()
    for kind, source in value.items():
        if kind == "json":
            msg.json = source if isinstance(source, str) else json.dumps(source)
        elif kind == "choice":
            msg.choice.extend(source)
        elif kind in ("regex", "json_object"):
            setattr(msg, kind, source)
        else:
            raise TypeError(f"unknown structured output {kind!r}; give json, regex, choice or json_object")


def _set_prompt(request: pb.GenerateRequest, prompt: Prompt) -> None:
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    else:
        # operator.index rejects floats and accepts numpy integers; set the oneof even when empty.
        request.prompt_token_ids.SetInParent()
        request.prompt_token_ids.ids.extend(operator.index(t) for t in prompt)


def _finish_reason(value: int) -> str | None:
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    try:
        return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()
    except ValueError:  # a reason newer than these stubs: still the last message
        return "unknown"


def _logprobs(msgs) -> list[TokenLogprob] | None:
    return [TokenLogprob(t.logprob, tuple(t.top_ids), tuple(t.top_logprobs), t.rank if t.HasField("rank") else None)
            for t in msgs] or None  # fmt: skip


def to_delta(msg: pb.GenerateResponse) -> Delta:
    finish_reason = _finish_reason(msg.finish_reason)
    if finish_reason is None:
        return Delta(text=msg.text, token_ids=list(msg.token_ids), request_id=msg.request_id,
                     logprobs=_logprobs(msg.logprobs), prompt_logprobs=_logprobs(msg.prompt_logprobs))  # fmt: skip
    stats = msg.spec_decode_stats
    return Delta(
        text=msg.text,
        token_ids=list(msg.token_ids),
        request_id=msg.request_id,
        logprobs=_logprobs(msg.logprobs),
        prompt_logprobs=_logprobs(msg.prompt_logprobs),
        finish_reason=finish_reason,
        usage=usage_from_proto(msg.usage),
        spec_decode_stats=SpecDecodeStats(
            num_drafts=stats.num_drafts,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
            num_accepted_tokens_per_pos=tuple(stats.num_accepted_tokens_per_pos),
        ),
    )


class ResumableStream:
    """One Generate stream across its submissions. When it breaks after some tokens (UNAVAILABLE: the gateway or
    the scheduler died), it is submitted again as the gateway migrates a request (`resume_request`): prompt +
    the tokens received, the remaining max_tokens, the same seed; the caller sees one stream.

    Resumable only where the rest is exactly what one run would give: a prompt of token ids (a text prompt's ids
    are known to the server alone) and no stop strings (text held back for a possible stop string at the break
    was never sent, and would be lost).
    """

    def __init__(self, request: pb.GenerateRequest, policy: RetryPolicy) -> None:
        sampling = request.sampling
        self.resumable = (policy.max_attempts > 1 and request.HasField("prompt_token_ids")
                          and not sampling.stop)  # fmt: skip
        sampled = not sampling.HasField("temperature") or sampling.temperature > 0
        if self.resumable and sampled and not sampling.HasField("seed"):
            request = _copy(request)  # each draw is keyed by (seed, output position): one seed for every submission
            request.sampling.seed = random.getrandbits(63)
        self.original = request
        self.output_ids: list[int] = []
        self.finished = False
        self.resumed = False  # the current submission continues an earlier one

    def request(self) -> pb.GenerateRequest:
        """What to submit now: the original, or its continuation after the tokens received."""
        self.resumed = bool(self.output_ids)
        if not self.resumed:
            return self.original
        return resume_request(self.original, self.original.prompt_token_ids.ids, self.output_ids)

    def take(self, msg: pb.GenerateResponse) -> Delta:
        delta = to_delta(msg)
        self.output_ids.extend(delta.token_ids)
        self.finished = self.finished or delta.finish_reason is not None
        if self.resumed and delta.usage is not None:  # the last submission counted its prompt from the break
            usage = dataclasses.replace(delta.usage, prompt_tokens=len(self.original.prompt_token_ids.ids),
                                        completion_tokens=len(self.output_ids))  # prediction counts: the server's
            delta = dataclasses.replace(delta, usage=usage)
        return delta

    def check_resumable(self, err: grpc.RpcError) -> None:
        """After a break: raise it unless the rest may be submitted (the retry policy still decides when, and
        if at all)."""
        if not self.resumable:
            raise MineDraftError.from_rpc_error(err) from err

    def check_finished(self) -> None:
        """After the server closed the stream with OK: raise if it never sent the final message."""
        if not self.finished:
            raise _incomplete_stream_error()


def _copy(request: pb.GenerateRequest) -> pb.GenerateRequest:
    copy = pb.GenerateRequest()
    copy.CopyFrom(request)
    return copy


def _incomplete_stream_error() -> MineDraftError:
    """The server closed the stream with OK but never sent the final message."""
    return MineDraftError(grpc.StatusCode.UNKNOWN, "Generate stream ended without a finish reason")


def completion_from_deltas(deltas: Iterable[Delta]) -> Completion:
    """Concatenate a finished stream (the last delta carries the finish reason and statistics)."""
    deltas = list(deltas)
    last = deltas[-1] if deltas else None
    if last is None or last.finish_reason is None or last.usage is None or last.spec_decode_stats is None:
        raise _incomplete_stream_error()
    return Completion(
        text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids],
        finish_reason=last.finish_reason,
        usage=last.usage,
        spec_decode_stats=last.spec_decode_stats,
        request_id=last.request_id,
        logprobs=[t for d in deltas for t in d.logprobs or []] if any(d.logprobs for d in deltas) else None,
        prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None),
    )


def channel_credentials(tls: Tls) -> grpc.ChannelCredentials | None:
    """None for a plaintext channel; otherwise the TLS credentials `tls` asks for."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()  # the system / gRPC bundled roots
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    if isinstance(tls, (str, os.PathLike)):
        return grpc.ssl_channel_credentials(root_certificates=Path(tls).read_bytes())
    raise TypeError(f"tls must be None, a bool, grpc.ChannelCredentials or a PEM path, got {type(tls).__name__}")


def channel_options(options: ChannelOptions | None) -> list[tuple[str, Any]]:
    return [("grpc.primary_user_agent", f"minedraft-python/{__version__}"), *(options or ())]


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    # Sent as plain metadata rather than call credentials, which gRPC refuses on insecure channels
    # (a cluster-internal server behind a mesh may still check the token).
    return (("authorization", f"Bearer {token}"),) if token else ()


class ClientBase:
    """What `Client` and `AsyncClient` share: the connection settings and the building of a stream.

    `tls`: None/False plaintext, True TLS with the system roots, a `grpc.ChannelCredentials`, or the path
    of a PEM root certificate. `token` is sent as `authorization: Bearer <token>` on every call. `timeout`
    is the default deadline of a call in seconds (None: none), covering all of its retries. `retries`: a
    RetryPolicy, or the number of retries after the first attempt (0/None: none); UNAVAILABLE only.
    """

    def __init__(
        self,
        target: str,
        *,
        tls: Tls = None,
        token: str | None = None,
        timeout: float | None = None,
        retries: RetryPolicy | int | None = DEFAULT_RETRY_POLICY,
        options: ChannelOptions | None = None,
    ) -> None:
        self._target = target
        self._creds = channel_credentials(tls)  # validated now, so a bad `tls` fails at construction
        self._options = channel_options(options)
        self._metadata = call_metadata(token)
        self._timeout = timeout
        self._retry = RetryPolicy.coerce(retries)
        self._connect()

    def _connect(self) -> None:
        """Open the channel: at construction (blocking client) or on first use (asyncio: bound to its loop)."""
        raise NotImplementedError

    def _resumable(self, prompt: Prompt, arguments: GenerateArguments) -> ResumableStream:
        return ResumableStream(build_generate_request(prompt, **arguments), self._retry)

    def _seconds(self, timeout: Timeout) -> float | None:
        """A call's deadline in seconds: its own, or the client's default."""
        return self._timeout if timeout is UNSET else timeout
