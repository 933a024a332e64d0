"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions (FastAPI).

A thin frontend over the same generate interface as the gRPC API. Streams are server-sent events ending
with `data: [DONE]`; errors have OpenAI's JSON shape. No body field is silently ignored: the request models
declare what is honoured, and every other field is refused with a 400 that names it, unless it is set to
what this server does anyway or is one of the few listed as ignored on purpose (`openai_fields.py`).

Three layers: the protocol (request bodies, the error shape: `openai_protocol.py`), the responses (chunks,
server-sent events: `openai_stream.py`), and here the app (routes, checks, wiring to the generator).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from minedraft.frontends.auth import ApiKeys
from minedraft.frontends.chat import ChatTemplate, ChatTemplateError
from minedraft.frontends.generate import GenerateError, Generation, Generator
from minedraft.frontends.openai_fields import refusals
from minedraft.frontends.openai_lora import LoraRoutes
from minedraft.frontends.openai_protocol import (
    STATUS,
    APIError,
    ChatCompletionBody,
    CompletionBody,
    DetokenizeBody,
    SamplingBody,
    TokenizeBody,
    error_body,
)
from minedraft.frontends.openai_stream import ChatStream, CompletionStream, respond, respond_best
from minedraft.sampling.params import SamplingParams
from minedraft.version import __version__
from minedraft.wire import describe_validation_error


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

    def check_model(self, body: SamplingBody) -> str | None:
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
            return await respond_best(generations, stream, body.n, samples, body.logprobs is not None)
        return await respond(generations, stream, body.stream, body.n)

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
        return await respond(generations, stream, body.stream, body.n)

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
        app.add_api_route("/debug/drafter-pool", self.drafter_pool, methods=["GET"], dependencies=auth)
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

    async def drafter_pool(self) -> dict:
        """Which pool drafter each engine group drafts with, and each member's load (null: a group without a
        pool). A scheduler answers for its own group (""), the gateway for every serving group."""
        pools = await self.generator.check_ready().drafter_pools(10)
        return {"groups": {address: _pool_view(pool) for address, pool in pools.items()}}

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


def _pool_view(pool) -> dict | None:
    if pool is None:
        return None
    members = [{"address": m.address, "serving": m.serving, "groups": m.groups, "capacity": m.capacity,
                "queue": m.queue} for m in pool.members]  # fmt: skip
    return {"bound": pool.bound, "members": members, "rebinds": pool.rebinds, "queue": pool.queue}


def _params(body: SamplingBody, max_tokens: int | None) -> SamplingParams:
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
