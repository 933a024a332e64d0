"""The OpenAI-compatible API's protocol: request bodies (pydantic models) and OpenAI's error shape.

The request models declare what is honoured; every other field a body carries is refused with a 400 that
names it, unless it is set to what this server does anyway or is one of the few listed as ignored on
purpose (`openai_fields.py`). The app is `openai_api.py`, the response chunks `openai_stream.py`.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

from minedraft.frontends.generate import ErrorKind
from minedraft.frontends.openai_fields import NOT_IMPLEMENTED, refusals
from minedraft.frontends.tools import Tool, ToolChoice, ToolUse, resolve
from minedraft.sampling.params import GREEDY_EPSILON, MAX_LOGPROBS, SamplingParams, Text

STATUS = {
    ErrorKind.INVALID: HTTPStatus.BAD_REQUEST,
    ErrorKind.DUPLICATE: HTTPStatus.CONFLICT,
    ErrorKind.BUSY: HTTPStatus.TOO_MANY_REQUESTS,
    ErrorKind.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorKind.INTERNAL: HTTPStatus.INTERNAL_SERVER_ERROR,
}
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.CONFLICT: "invalid_request_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
}


class APIError(Exception):
    def __init__(self, status: HTTPStatus, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: HTTPStatus, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --- request bodies ----------------------------------------------------------------------------------------

MAX_CHOICES = 64  # choices (prompts x n) in one request: each is a request of its own to the engine


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    include_obfuscation: StrictBool = False  # ignored on purpose: chunks are never padded, their content is the same


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class PredictionBody(BaseModel):
    """OpenAI's Predicted Outputs: the text the output is expected to be (a string, or text parts)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: Text | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class SamplingBody(BaseModel):
    """Fields both endpoints share; vLLM's extras (top_k, ignore_eos, stop_token_ids) map to ours.

    Types are strict (no bool for a number, no string for a bool); ranges are SamplingParams' and the
    engine's, checked before anything reaches a step."""

    model_config = ConfigDict(extra="allow")  # kept, so that each is honoured, refused or ignored by name

    model: str | None = None  # None: the served model
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: Text | list[Text] | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: StrictInt | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    repetition_penalty: StrictFloat | None = None
    min_p: StrictFloat | None = None
    min_tokens: StrictInt | None = None
    bad_words: list[Text] | None = None
    num_speculative_tokens: StrictInt | None = None  # ours: the most this request may draft (0 = plainly)
    prediction: PredictionBody | None = None  # OpenAI's Predicted Outputs: drafts come from it where it matches
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for fields set to something this server cannot do: refused rather than silently ignored."""
        return refusals(self.model_extra or {}, add_special_tokens=not isinstance(self, ChatCompletionBody))

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        options = {"presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                   "repetition_penalty": self.repetition_penalty, "min_p": self.min_p, "min_tokens": self.min_tokens,
                   "bad_words": self.bad_words, "num_speculative_tokens": self.num_speculative_tokens,
                   "prediction": self.prediction.text or None if self.prediction else None}
        return SamplingParams(
            **{name: value for name, value in options.items() if value is not None},
            logit_bias=_token_bias(self.logit_bias),
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.num_prompt_logprobs(),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,  # vLLM: 0 and -1 both mean "all"
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            structured_outputs=self.structured(),
        )

    def structured(self) -> dict[str, Any] | None:
        """The one grammar the request asks for, as SamplingParams' structured_outputs (None: free text)."""
        given = {
            "response_format": _response_format(self.response_format),
            "structured_outputs": self.structured_outputs,
            "guided_json": {"json": self.guided_json} if self.guided_json else None,
            "guided_regex": {"regex": self.guided_regex} if self.guided_regex else None,
            "guided_choice": {"choice": self.guided_choice} if self.guided_choice else None,
        }
        asked = [name for name, value in given.items() if value]
        if len(asked) > 1:
            raise APIError(HTTPStatus.BAD_REQUEST, f"give one structured output, not {' and '.join(asked)}", asked[1])
        return given[asked[0]] if asked else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def num_logprobs(self) -> int | None:
        """Top tokens to return with each output token's logprob; None: no logprobs."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """Top tokens to return with each prompt token's logprob; None: no prompt logprobs."""
        return None


class CompletionBody(SamplingBody):
    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: Text | None = None
    prompt_logprobs: StrictInt | None = None  # vLLM's: each prompt token's logprob and this many top ones'

    def unsupported(self) -> list[tuple[str, str]]:
        refused = [("suffix", NOT_IMPLEMENTED["suffix"])] * bool(self.suffix)
        refused += [("echo", "echo with logprobs is not implemented (prompt_logprobs returns the prompt's)")] * (
            self.echo and self.logprobs is not None)  # fmt: skip
        return super().unsupported() + refused

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def samples(self) -> int:
        """Samples generated per prompt: best_of (vLLM's, checked here), else n."""
        if self.best_of is None or self.best_of == self.n:
            return self.n
        if self.best_of < self.n:
            raise APIError(HTTPStatus.BAD_REQUEST, f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
        if self.best_of > MAX_CHOICES:
            raise APIError(HTTPStatus.BAD_REQUEST, f"best_of must be at most {MAX_CHOICES}", "best_of")
        if self.stream:
            raise APIError(HTTPStatus.BAD_REQUEST, "best_of greater than n cannot be streamed (the best are known "
                           "only once all are done)", "best_of")  # fmt: skip
        if self.temperature is not None and self.temperature < GREEDY_EPSILON:
            raise APIError(HTTPStatus.BAD_REQUEST, "best_of greater than n needs random sampling: with temperature 0 "
                           "every sample is the same", "best_of")  # fmt: skip
        return self.best_of

    def prompts(self) -> list[str | list[int]]:
        """The prompts: a string or token ids, or a list of those (one choice per prompt and sample)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) * self.samples > MAX_CHOICES:
                raise APIError(HTTPStatus.BAD_REQUEST, f"{len(prompt)} prompts x {self.samples} samples (n or "
                               f"best_of) is more than the {MAX_CHOICES} choices one request may have",
                               "prompt")  # fmt: skip
            return list(prompt)
        return [prompt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused by name unless empty (`ChatCompletionBody.unsupported`)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as a response returned them
    tool_call_id: Text | None = None  # a tool message's answer to that call

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        """One clear line for an image, audio or file part, instead of every union member's complaint."""
        for part in value if isinstance(value, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" and isinstance(kind, str):
                raise ValueError(f"this model takes text only (a content part of type {kind!r})")
        return value

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_with_argument_dict(call) for call in self.tool_calls]
        return message


def _with_argument_dict(call: dict[str, Any]) -> dict[str, Any]:
    """Templates render a call's arguments as an object (as transformers expects them); OpenAI sends JSON text."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class ChatCompletionBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: auto with tools, none without
    parallel_tool_calls: StrictBool | None = None  # default: true
    # vLLM's extras for templates
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        messages = [r for i, m in enumerate(self.messages) for r in refusals(m.model_extra or {}, False,
                                                                              f"messages[{i}].")]  # fmt: skip
        return super().unsupported() + messages

    def tool_use(self) -> ToolUse | None:
        try:
            return resolve(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ValueError as exc:
            raise APIError(HTTPStatus.BAD_REQUEST, str(exc), "tool_choice") from None

    def structured(self) -> dict[str, Any] | None:
        """A required or named tool choice guarantees its calls with a grammar of its own."""
        asked, tool_use = super().structured(), self.tool_use()
        calls = tool_use.grammar() if tool_use else None
        if calls and asked:
            raise APIError(HTTPStatus.BAD_REQUEST, "tool_choice required or a named function gives the output "
                           "a grammar of its own: it cannot be combined with structured output",
                           "tool_choice")  # fmt: skip
        return calls or asked

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(HTTPStatus.BAD_REQUEST, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for rendered messages
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


def _token_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI sends logit_bias keyed by token ids as strings."""
    try:
        return {int(token): value for token, value in (bias or {}).items()}
    except ValueError:
        raise APIError(HTTPStatus.BAD_REQUEST, "logit_bias: keys must be token ids (integers as strings)",
                       "logit_bias") from None  # fmt: skip


def _response_format(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's response_format as structured_outputs: text (None), json_object, or json_schema."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    described = response_format.get("json_schema") if kind == "json_schema" else None
    schema = described.get("schema") if isinstance(described, dict) else None
    if not isinstance(schema, dict):
        raise APIError(HTTPStatus.BAD_REQUEST, "response_format must be {'type': 'text'}, {'type': 'json_object'} "
                       "or {'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
                       "response_format")  # fmt: skip
    return {"json": schema}
