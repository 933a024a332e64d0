"""The public gRPC API (`minedraft.v1.MineDraft`): a thin frontend over the generate interface."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import grpc

from minedraft.api import generate_pb2
from minedraft.config import EngineConfig, LoraModule
from minedraft.engine.engine import LoraRefused
from minedraft.engine_client import StreamItem
from minedraft.frontends.generate import ErrorKind, GenerateError, Generator
from minedraft.model.config import load_model_config
from minedraft.serving import parse_generate, parse_request, request_prompt
from minedraft.version import __version__
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
            await context.abort(STATUS[exc.kind], exc.message)
        except LoraRefused as exc:
            await context.abort(LORA_STATUS[exc.kind], str(exc))


class MineDraftServicer(LoraUpdates):
    def __init__(self, generator: Generator, config: EngineConfig) -> None:
        self.generator = generator
        self.config = config

    async def Generate(self, request_bytes: bytes, context: grpc.aio.ServicerContext):  # noqa: N802
        request, params = await parse_generate(request_bytes, context)
        prompt = request_prompt(request)
        try:
            generation = await self.generator.start(prompt, params, request.request_id or None,
                                                    lora=request.lora_adapter or None)  # fmt: skip
            async with generation:
                async for item in generation:
                    yield _response(generation.request_id, item)
        except GenerateError as exc:
            await context.abort(STATUS[exc.kind], exc.message)

    async def GetServerInfo(self, request_bytes: bytes, context) -> generate_pb2.ServerInfo:  # noqa: N802
        await parse_request(generate_pb2.GetServerInfoRequest, request_bytes, context)
        try:
            engine = self.generator.check_ready()
        except GenerateError as exc:
            await context.abort(STATUS[exc.kind], exc.message)
        spec = self.config.speculative_config
        num_kv_blocks, kv_block_size = engine.kv_pool or (0, 0)
        return generate_pb2.ServerInfo(
            version=__version__,
            target_model=str(self.config.target_path),
            draft_model=str(self.config.draft_path) if spec else "",
            mode=self.config.mode.value,
            speculative_config_json=json.dumps(spec.model_dump(exclude_none=True)) if spec else "",
            tensor_parallel_size=self.config.tensor_parallel_size,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=engine.max_model_len,
            max_waiting_requests=self.generator.limits.max_waiting,
            vocab_size=self.generator.tokenizer.vocab_size,
            num_kv_blocks=num_kv_blocks,
            kv_block_size=kv_block_size,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            draft_method=spec.draft_method if spec else "",
            enable_prefix_caching=self.config.enable_prefix_caching,
            quantization=checkpoint_quantization(self.config.target_path),
            draft_quantization=checkpoint_quantization(self.config.draft_path) if spec else "",
            speculation_json=json.dumps(engine.speculation) if engine.speculation else "",
            lora_adapters=engine.lora_adapters,
        )


@functools.cache
def checkpoint_quantization(path: Path) -> str:
    """The checkpoint's quantization as GetServerInfo reports it (the folder is read once)."""
    quant = load_model_config(path).quantization
    return quant.describe() if quant else ""


def _response(request_id: str, item: StreamItem) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(request_id=request_id, text=item.text, token_ids=item.token_ids,
                                              logprobs=logprobs_to_proto(item.logprobs),
                                              prompt_logprobs=logprobs_to_proto(item.prompt_logprobs))  # fmt: skip
    done = item.finished
    if done is not None:
        response.finish_reason = finish_reason_to_proto(done.finish_reason)
        response.usage.prompt_tokens = len(done.prompt_ids)
        response.usage.completion_tokens = len(done.output_ids)
        response.spec_decode_stats.CopyFrom(stats_to_proto(done.stats))
    return response
