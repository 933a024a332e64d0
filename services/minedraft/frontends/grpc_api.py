"""The public gRPC API (`minedraft.v1.MineDraft`): a thin frontend over the generate interface.

One servicer for every process that serves the API: a scheduler (over its step loop) and the gateway (over
its routed engine, which places each request on an engine group); what differs lives in the engine client.
"""

from __future__ import annotations

import time

import grpc

from minedraft.api import generate_pb2
from minedraft.config import LoraModule
from minedraft.engine.loras import LoraRefused
from minedraft.engine_client import StreamItem
from minedraft.frontends.generate import ErrorKind, GenerateError, Generator
from minedraft.frontends.grpc_server import parse_generate, parse_request, request_prompt
from minedraft.wire import finish_reason_to_proto, logprobs_to_proto, stats_to_proto

STATUS = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
# LoraRefused.kind -> status; the gateway reads them back (`lora_refusal`)
LORA_STATUS = {
    "off": grpc.StatusCode.UNIMPLEMENTED,
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "exists": grpc.StatusCode.ALREADY_EXISTS,
    "not_found": grpc.StatusCode.NOT_FOUND,
}


def lora_refusal(code: grpc.StatusCode, details: str) -> LoraRefused | None:
    """A group's refusal of a LoRA load or unload, as the engine raised it (None: another failure)."""
    kind = next((k for k, c in LORA_STATUS.items() if c == code), None)
    return LoraRefused(kind, details) if kind else None


class LoraUpdates:
    """LoadLoraAdapter and UnloadLoraAdapter over the generator's engine (the scheduler's, or the gateway's
    over every group): what the HTTP routes /v1/load_lora_adapter and /v1/unload_lora_adapter do."""

    generator: Generator

    async def LoadLoraAdapter(self, request_bytes: bytes, context) -> generate_pb2.LoraAdapterReply:  # noqa: N802
        request = await parse_request(generate_pb2.LoadLoraAdapterRequest, request_bytes, context)
        if not request.lora_name or not request.lora_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path are required")
        module = LoraModule(name=request.lora_name, path=request.lora_path, draft_path=request.draft_path or None)
        await self._update(context, self._engine_call("load_lora", module))
        return generate_pb2.LoraAdapterReply(message=f"LoRA adapter {request.lora_name!r} loaded")

    async def UnloadLoraAdapter(self, request_bytes: bytes, context) -> generate_pb2.LoraAdapterReply:  # noqa: N802
        request = await parse_request(generate_pb2.UnloadLoraAdapterRequest, request_bytes, context)
        await self._update(context, self._engine_call("unload_lora", request.lora_name))
        return generate_pb2.LoraAdapterReply(message=f"LoRA adapter {request.lora_name!r} unloaded")

    async def _engine_call(self, method: str, argument) -> None:
        await getattr(self.generator.check_ready(), method)(argument)

    @staticmethod
    async def _update(context, call) -> None:
        try:
            await call
        except GenerateError as exc:
            await context.abort(status_of(exc), exc.message)
        except LoraRefused as exc:
            await context.abort(LORA_STATUS[exc.kind], str(exc))


class MineDraftServicer(LoraUpdates):
    def __init__(self, generator: Generator) -> None:
        self.generator = generator

    async def Generate(self, request_bytes: bytes, context: grpc.aio.ServicerContext):  # noqa: N802
        request, params = await parse_generate(request_bytes, context)
        prompt = request_prompt(request)
        try:
            generation = await self.generator.start(prompt, params, request.request_id or None,
                                                    lora=request.lora_adapter or None,
                                                    deadline=_deadline(context))  # fmt: skip
            async with generation:
                async for item in generation:
                    yield _response(generation.request_id, item)
        except GenerateError as exc:
            await context.abort(status_of(exc), exc.message)

    async def GetServerInfo(self, request_bytes: bytes, context) -> generate_pb2.ServerInfo:  # noqa: N802
        await parse_request(generate_pb2.GetServerInfoRequest, request_bytes, context)
        try:
            return await self.generator.check_ready().server_info(context.time_remaining())
        except GenerateError as exc:
            await context.abort(status_of(exc), exc.message)


def status_of(exc: GenerateError) -> grpc.StatusCode:
    """The status a remote engine gave, as it came; else the error kind's."""
    return grpc.StatusCode[exc.grpc_status] if exc.grpc_status else STATUS[exc.kind]


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _response(request_id: str, item: StreamItem) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(request_id=request_id, text=item.text, token_ids=item.token_ids,
                                              logprobs=logprobs_to_proto(item.logprobs),
                                              prompt_logprobs=logprobs_to_proto(item.prompt_logprobs))  # fmt: skip
    done = item.finished
    if done is not None:
        response.finish_reason = finish_reason_to_proto(done.finish_reason)
        response.usage.prompt_tokens = len(done.prompt_ids)
        response.usage.completion_tokens = len(done.output_ids)
        if done.prediction_usage is not None:
            accepted, rejected = done.prediction_usage
            response.usage.accepted_prediction_tokens, response.usage.rejected_prediction_tokens = accepted, rejected
        response.spec_decode_stats.CopyFrom(stats_to_proto(done.stats))
    return response
