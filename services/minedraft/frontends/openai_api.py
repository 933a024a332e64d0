"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions (FastAPI).

A thin frontend over the same generate interface as the gRPC API. Streams are server-sent events ending
with `data: [DONE]`; errors have OpenAI's JSON shape. No body field is silently ignored: the request models
declare what is honoured, and every other field is refused with a 400 that names it, unless it is set to
what this server does anyway or is one of the few listed as ignored on purpose (`openai_fields.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, field_validator
from starlette.exceptions import HTTPException

from minedraft.engine.request import Request as EngineRequest
from minedraft.engine.request import SpecDecodeStats
from minedraft.engine_client import StreamItem
from minedraft.frontends.auth import ApiKeys
from minedraft.frontends.chat import ChatTemplate, ChatTemplateError
from minedraft.frontends.generate import ErrorKind, GenerateError, Generation, Generator
from minedraft.frontends.openai_fields import NOT_IMPLEMENTED, refusals
from minedraft.frontends.openai_lora import LoraRoutes
from minedraft.frontends.tools import Tool, ToolChoice, ToolUse, new_call_id, resolve
from minedraft.model.tokenizer import Tokenizer
from minedraft.sampling.params import GREEDY_EPSILON, MAX_LOGPROBS, SamplingParams, Text, TokenLogprob
from minedraft.version import __version__
from minedraft.wire import describe_validation_error

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


class _SamplingBody(BaseModel):
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
                   "bad_words": self.bad_words, "num_speculative_tokens": self.num_speculative_tokens}
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


class CompletionBody(_SamplingBody):
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


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


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


class ChatCompletionBody(_SamplingBody):
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


# --- the app -----------------------------------------------------------------------------------------------


class OpenAIFrontend:
    def __init__(
        self,
        generator: Generator,
        served_model_name: str,
        chat_template: ChatTemplate | None,
        api_keys: ApiKeys,
        is_serving: Callable[[], bool],
        registry: CollectorRegistry | None = None,
        max_body_bytes: int | None = None,
        decoding: dict[str, str] | None = None,
        spec_decode_metrics: str | None = None,
        lora_adapters: list[str] | None = None,
    ) -> None:
        """`spec_decode_metrics`: 'summary' or 'detailed' (see settings' per_request_spec_decode_metrics).
        `lora_adapters`: the LoRA adapters served, which a request's `model` picks by name (as vLLM's)."""
        self._lora_adapters = lora_adapters or []
        self.generator = generator
        self.spec_decode_metrics = spec_decode_metrics
        self.decoding = decoding or {}
        self.max_body_bytes = max_body_bytes
        self.model_name = served_model_name
        self.chat_template = chat_template
        self.api_keys = api_keys
        self.is_serving = is_serving
        self.registry = registry
        self.created = int(time.time())

    @property
    def lora_adapters(self) -> list[str]:
        """The adapters served now: the engine's (they change with run-time loads), or those given at start."""
        engine = self.generator.engine
        return engine.lora_adapters if engine is not None else self._lora_adapters

    @lora_adapters.setter
    def lora_adapters(self, names: list[str]) -> None:
        self._lora_adapters = names

    async def check_key(self, request: Request) -> None:  # async: FastAPI runs sync dependencies in threads
        if not self.api_keys.allows(request.headers.get("authorization")):
            raise APIError(HTTPStatus.UNAUTHORIZED, "missing or invalid API key: send 'Authorization: Bearer <key>'")

    def check_model(self, body: _SamplingBody) -> str | None:
        """The LoRA adapter the body's `model` names (None: the base model); refuses what is not served."""
        lora = self._adapter(body.model)
        unsupported = body.unsupported()
        if unsupported:
            reasons = "; ".join(f"{name} ({why})" for name, why in unsupported)
            raise APIError(HTTPStatus.BAD_REQUEST, f"not supported by this server: {reasons}", unsupported[0][0])
        return lora

    async def models(self) -> dict:
        if not self.is_serving():  # tools poll this to know when to start: ready means a request could run
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is not serving now (starting, or forming its "
                           "engine group again after a worker failed): retry later")  # fmt: skip
        return {"object": "list", "data": [self._model_card(None)] + [self._model_card(a) for a in self.lora_adapters]}

    async def model(self, model_id: str) -> dict:
        return self._model_card(self._adapter(model_id))

    def _model_card(self, lora: str | None) -> dict:
        """The base model's card, or an adapter's: vLLM's shape, whose `parent` is the base model's name."""
        return {"id": lora or self.model_name, "object": "model", "created": self.created, "owned_by": "minedraft",
                "root": lora or self.model_name, "parent": self.model_name if lora else None,
                "max_model_len": self.generator.max_model_len, "decoding": self.decoding}  # fmt: skip

    async def completions(self, body: CompletionBody) -> Response:
        lora = self.check_model(body)
        params, prompts, samples = _params(body, body.max_tokens), body.prompts(), body.samples
        if samples > body.n and params.logprobs is None:  # ranking needs each token's logprob; not returned
            params = params.model_copy(update={"logprobs": 0})
        generations = await _start_all(self.generator, prompts, params, samples, fit_context=True, lora=lora)
        echo = [self._prompt_text(p) for p in prompts for _ in range(body.n)] if body.echo else None
        stream = CompletionStream(f"cmpl-{uuid.uuid4().hex}", lora or self.model_name, body.include_usage,
                                  self.generator.tokenizer, echo=echo)  # fmt: skip
        stream.spec_decode_metrics = self.spec_decode_metrics
        if samples > body.n:
            return await _respond_best(generations, stream, body.n, samples, body.logprobs is not None)
        return await _respond(generations, stream, body.stream, body.n)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        """What `echo` puts before the output: the prompt as sent, or its token ids decoded."""
        return prompt if isinstance(prompt, str) else self.generator.tokenizer.decode(list(prompt))

    async def chat_completions(self, body: ChatCompletionBody) -> Response:
        lora = self.check_model(body)
        prompt = self._render(body)
        asked = next((n for n in (body.max_completion_tokens, body.max_tokens) if n is not None), None)
        max_tokens = self.generator.max_model_len if asked is None else asked  # none asked: what the context leaves
        generations = await _start_all(self.generator, [prompt], _params(body, max_tokens), body.n,
                                       add_special_tokens=False, fit_context=asked is not None, lora=lora)  # fmt: skip
        stream = ChatStream(f"chatcmpl-{uuid.uuid4().hex}", lora or self.model_name, body.include_usage,
                            self.generator.tokenizer, tools=body.tool_use())  # fmt: skip
        stream.spec_decode_metrics = self.spec_decode_metrics
        return await _respond(generations, stream, body.stream, body.n)

    def _render(self, body: ChatCompletionBody | TokenizeBody) -> str:
        if self.chat_template is None:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"model {self.model_name!r} has no chat template (no chat_template in its tokenizer_config.json); "
                "use /v1/completions",
                "messages",
            )
        messages = [m.as_template_input() for m in body.messages]
        kwargs = dict(body.chat_template_kwargs or {})
        if body.tools:
            if not self.chat_template.takes_tools:
                raise APIError(HTTPStatus.BAD_REQUEST, f"not supported by this server: tools (the chat template of "
                               f"{self.model_name!r} does not render tools)", "tools")  # fmt: skip
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
        if "messages" in kwargs:
            raise APIError(HTTPStatus.BAD_REQUEST, "chat_template_kwargs cannot replace the messages: send them as "
                           "`messages`", "chat_template_kwargs.messages")  # fmt: skip
        add_generation_prompt = kwargs.pop("add_generation_prompt", body.add_generation_prompt)  # as vLLM: kwargs win
        try:
            return self.chat_template.render(messages, add_generation_prompt, **kwargs)
        except ChatTemplateError as exc:
            raise APIError(HTTPStatus.BAD_REQUEST, str(exc), "messages") from exc

    def app(self) -> FastAPI:
        app = FastAPI(title="MineDraft OpenAI-compatible API", docs_url=None, redoc_url=None)
        auth = [Depends(self.check_key)]
        app.add_api_route("/v1/models", self.models, methods=["GET"], dependencies=auth)
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"], dependencies=auth)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], dependencies=auth)
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"], dependencies=auth)
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"], dependencies=auth)
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"], dependencies=auth)
        app.add_api_route("/debug/speculation", self.speculation, methods=["GET"], dependencies=auth)
        LoraRoutes(self.generator, self.model_name, APIError).add_to(app, auth)
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        if self.registry is not None:  # a route, not a mounted app: /metrics answers itself, no redirect
            app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_exception_handler(APIError, _api_error)
        app.add_exception_handler(GenerateError, _generate_error)
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_exception_handler(HTTPException, _http_error)  # 404, 405, ...: OpenAI's shape, not FastAPI's
        if self.max_body_bytes:
            app.add_middleware(BodyLimit, max_bytes=self.max_body_bytes)
        return app

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, body: TokenizeBody) -> dict:
        self._adapter(body.model)  # an adapter shares the base model's tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(HTTPStatus.BAD_REQUEST, "send either `prompt` or `messages`", "prompt")
        refused = [r for i, m in enumerate(body.messages or []) for r in refusals(m.model_extra or {}, False,
                                                                                   f"messages[{i}].")]  # fmt: skip
        if refused:
            raise APIError(HTTPStatus.BAD_REQUEST, f"not supported by this server: {refused[0][0]} ({refused[0][1]})",
                           refused[0][0])  # fmt: skip
        text = body.prompt if body.messages is None else self._render(body)
        special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
        tokens = await asyncio.to_thread(self.generator.tokenizer.encode_concurrently, text, special)
        return {"count": len(tokens), "max_model_len": self.generator.max_model_len, "tokens": tokens,
                "token_strs": None}  # fmt: skip

    async def detokenize(self, body: DetokenizeBody) -> dict:
        self._adapter(body.model)  # an adapter shares the base model's tokenizer
        vocab = self.generator.tokenizer.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(HTTPStatus.BAD_REQUEST, f"tokens: token ids must be in [0, {vocab})", "tokens")
        return {"prompt": self.generator.tokenizer.decode(body.tokens)}

    async def version(self) -> dict:
        return {"version": __version__}

    async def speculation(self) -> dict:
        """Why the server speculates as it does: GetServerInfo's speculation_json (null when fixed or off)."""
        return {"speculation": self.generator.check_ready().speculation}

    def _adapter(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names: None for the base model; 404 in OpenAI's shape for a name not served."""
        if model is None or model == self.model_name:
            return None
        if model in self.lora_adapters:
            return model
        raise APIError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", "model", "model_not_found")

    async def health(self) -> Response:
        serving = self.is_serving()
        return Response(status_code=200 if serving else 503, content="" if serving else "not serving")


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


def _params(body: _SamplingBody, max_tokens: int | None) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens if max_tokens is not None else 16)
    except ValidationError as exc:
        raise APIError(HTTPStatus.BAD_REQUEST, describe_validation_error(exc)) from exc


async def _start(generator: Generator, prompt, params: SamplingParams, **kwargs) -> Generation:
    if isinstance(prompt, list) and any(isinstance(t, list) for t in prompt):
        raise APIError(HTTPStatus.BAD_REQUEST, "prompt must be a string or a list of token ids", "prompt")
    return await generator.start(prompt, params, **kwargs)


async def _start_all(generator: Generator, prompts: list, params: SamplingParams, n: int, **kwargs) -> list[Generation]:
    """`n` samples of each prompt, in choice order (prompt by prompt); all admitted, or none (those already
    admitted are closed when one is refused). Sample j > 0 of a seeded request gets a seed of its own."""
    generations: list[Generation] = []
    try:
        for prompt in prompts:
            for j in range(n):
                seed = params.seed if params.seed is None or j == 0 else (params.seed + j * _GOLDEN) % 2**64
                generations.append(await _start(generator, prompt, params.model_copy(update={"seed": seed}), **kwargs))
    except BaseException:
        for generation in generations:
            await generation.aclose()
        raise
    return generations


_GOLDEN = 0x9E3779B97F4A7C15  # spreads the seeds of one request's samples over the 64-bit range


# --- responses ---------------------------------------------------------------------------------------------

Logprobs = list[tuple[int, TokenLogprob]] | None  # (token id, its logprobs) per output token


def _vllm_spec_counts(stats: SpecDecodeStats) -> dict:
    """vLLM's names for the same counts, and its acceptance histogram (index j: the verifications that
    accepted exactly j draft tokens). Acceptance stops at the first rejection, so position i was accepted in
    the verifications that accepted more than i tokens, whatever k each one drafted."""
    at_least = [stats.num_drafts, *stats.num_accepted_tokens_per_pos, 0]  # verifications accepting >= j
    rate = stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.0
    return {"num_spec_steps": stats.num_drafts, "num_accepted_draft_tokens": stats.num_accepted_tokens,
            "draft_acceptance_rate": rate, "acceptance_histogram": [a - b for a, b in zip(at_least, at_least[1:])]}


class _Stream:
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


class CompletionStream(_Stream):
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


class ChatStream(_Stream):
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
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _respond(generations: list[Generation], stream: _Stream, streaming: bool, n: int = 1) -> Response:
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


async def _respond_best(generations: list[Generation], stream: _Stream, n: int, samples: int,
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


def _add_prompt_logprobs(stream: _Stream, choice: dict, generation: Generation, items: list[StreamItem]) -> None:
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


async def _sse(generations: list[Generation], stream: _Stream, n: int) -> AsyncIterator[str]:
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


class BodyLimit:
    """413 for a body larger than `max_bytes`: refused on its declared length, or read here (as FastAPI would
    read it anyway) and refused as soon as it grows past the limit, chunked or not."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
            more = message.get("more_body", False)
        body: dict | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal body
            if body is None:
                return await receive()  # after the body: disconnects, as the app expects
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        message = f"request body is larger than this server accepts ({self.max_bytes} bytes, --max-prompt-bytes)"
        response = JSONResponse(error_body(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message), status_code=413)
        await response(scope, receive, send)


# --- errors ------------------------------------------------------------------------------------------------


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    status = HTTPStatus(exc.status_code)
    return JSONResponse(error_body(status, str(exc.detail)), status_code=status, headers=exc.headers)


async def _generate_error(request: Request, exc: GenerateError) -> JSONResponse:
    status = STATUS[exc.kind]
    return JSONResponse(error_body(status, exc.message), status_code=status)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's messages, one per bad field, as a 400 (OpenAI's status for a malformed body)."""
    parts, params = [], []
    for error in exc.errors():
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        params.append(".".join(loc))
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg')}")
    param = params[0] if params and params[0] else None
    return JSONResponse(error_body(HTTPStatus.BAD_REQUEST, "; ".join(parts), param), status_code=400)
