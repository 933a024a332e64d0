"""The public gRPC API's server (`minedraft.v1.MineDraft`), as the scheduler and the gateway both start it.

Its requests arrive as bytes and the handlers (`grpc_api.py`) parse them here rather than in gRPC's
deserializer, so that undecodable bytes and fields unknown to these stubs get INVALID_ARGUMENT with a reason
(a failing deserializer surfaces as UNKNOWN). Health and reflection are served beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from pydantic import ValidationError

from minedraft.api import generate_pb2
from minedraft.service.grpc_server import MAX_MESSAGE_BYTES, PUBLIC_SERVICE, add_health_and_reflection, listen
from minedraft.wire import describe_validation_error, sampling_from_proto


async def parse_request(message_type, data: bytes, context: grpc.aio.ServicerContext):
    """A public API request of `message_type`, or INVALID_ARGUMENT saying why its bytes do not decode."""
    try:
        return message_type.FromString(data)
    except DecodeError as exc:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"cannot decode the {message_type.DESCRIPTOR.name} message: {exc}"
        )


def request_prompt(request: generate_pb2.GenerateRequest) -> str | list[int]:
    """The prompt a Generate request carries: its token ids, or its text."""
    return list(request.prompt_token_ids.ids) if request.HasField("prompt_token_ids") else request.prompt


async def parse_generate(data: bytes, context: grpc.aio.ServicerContext):
    """A Generate request and its sampling parameters, or INVALID_ARGUMENT naming what is wrong."""
    request = await parse_request(generate_pb2.GenerateRequest, data, context)
    unknown = _unknown_fields(request) or _unknown_fields(request.sampling)
    if unknown:
        message = f"{unknown}: unknown to this server (a newer generate.proto?); it would be ignored, so it is refused"
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
    try:
        return request, sampling_from_proto(request.sampling)
    except ValidationError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, describe_validation_error(exc))


def _unknown_fields(message) -> str | None:
    """The first field the message carries that these stubs do not know, named by its number."""
    fields = UnknownFieldSet(message)
    if len(fields) == 0:
        return None
    return f"{message.DESCRIPTOR.name} field number {fields[0].field_number}"


def add_public_api(servicer, server: grpc.aio.Server) -> None:
    """Register the MineDraft service with raw-bytes requests: `servicer.Generate`, `GetServerInfo`,
    `LoadLoraAdapter` and `UnloadLoraAdapter` take (request bytes, context) and parse them with `parse_request`."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, response_serializer=generate_pb2.GenerateResponse.SerializeToString
        ),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo, response_serializer=generate_pb2.ServerInfo.SerializeToString
        ),
        "LoadLoraAdapter": grpc.unary_unary_rpc_method_handler(
            servicer.LoadLoraAdapter, response_serializer=generate_pb2.LoraAdapterReply.SerializeToString
        ),
        "UnloadLoraAdapter": grpc.unary_unary_rpc_method_handler(
            servicer.UnloadLoraAdapter, response_serializer=generate_pb2.LoraAdapterReply.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PUBLIC_SERVICE, handlers),))


async def start_public_server(
    servicer,
    health_servicer,
    address: str,
    *,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: tuple[str, str] | None = None,
    flag: str = "--port",
) -> tuple[grpc.aio.Server, int]:
    """Start the public MineDraft API as the scheduler and the gateway both serve it: `servicer` (see
    `add_public_api`), grpc.health.v1 (`health_servicer`, an asyncio one) and reflection; `tls` is (cert,
    key) PEM paths. Returns the server and the bound port; raises OSError if `address` cannot be bound."""
    options = [  # requests over max_receive_bytes fail before they are parsed
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options, interceptors=list(interceptors))
    add_public_api(servicer, server)
    add_health_and_reflection(server, health_servicer, PUBLIC_SERVICE)
    credentials = None
    if tls is not None:
        cert, key = (Path(path).read_bytes() for path in tls)
        credentials = grpc.ssl_server_credentials([(key, cert)])
    bound = listen(server, address, flag, credentials)
    await server.start()
    return server, bound
