"""gRPC plumbing shared by the three services: health, reflection, ports, graceful shutdown."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from minedraft.api import generate_pb2, worker_pb2
from minedraft.settings import ListenError
from minedraft.wire import describe_validation_error, sampling_from_proto

if TYPE_CHECKING:
    from minedraft.worker_node import WorkerNode

log = logging.getLogger("minedraft")

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
PUBLIC_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["MineDraft"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a plan admitting many long prompts can be large


def grpc_options(server: bool = False) -> list[tuple[str, int]]:
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    if server:  # a port already in use must fail, not be silently shared with another process
        options.append(("grpc.so_reuseport", 0))
    return options


def add_health_and_reflection(server, health_servicer, service_name: str) -> None:
    """Register grpc.health.v1 (NOT_SERVING until `set_serving`) and server reflection."""
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([service_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)


async def parse_request(message_type, data: bytes, context: grpc.aio.ServicerContext):
    """Parse a public API request in its handler rather than in gRPC's deserializer, so that undecodable
    bytes get INVALID_ARGUMENT with a reason (a failing deserializer surfaces as UNKNOWN)."""
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
    bound = _bind(server, address, flag, credentials)
    await server.start()
    return server, bound


def _bind(server, address: str, flag: str, credentials=None) -> int:
    """Listen on `address`; ListenError naming `flag` if that fails (grpc raises or returns 0, by version)."""
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ListenError(flag, address)
    return bound


def start_worker_server(
    servicer, host: str, port: int, max_workers: int = 8
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """Start a threaded gRPC server for a drafter or verifier; health starts as NOT_SERVING."""
    from minedraft.api import worker_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=grpc_options(server=True))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    set_status(health_servicer, WORKER_SERVICE, serving=False)
    add_health_and_reflection(server, health_servicer, WORKER_SERVICE)
    bound = _bind(server, f"{host}:{port}", "--port")
    server.start()
    return server, health_servicer, bound


def is_serving(channel: grpc.Channel, timeout_s: float = 2.0) -> bool:
    """Whether the server behind `channel` answers its health check with SERVING (not answering: False)."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def set_status(health_servicer, service_name: str, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", service_name):
        health_servicer.set(name, status)


async def set_public_status(health_servicer, serving: bool) -> None:
    """`set_status` for the public API's asyncio health servicer (scheduler and gateway)."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", PUBLIC_SERVICE):
        await health_servicer.set(name, status)


def wait_for_termination(stop: Callable[[], None]) -> None:
    """Block until SIGINT or SIGTERM, then call `stop` once."""
    done = threading.Event()

    def handle(signum, _frame) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
    done.wait()
    stop()


def serve_until_stopped(servicer: NodeServicer, server: grpc.Server, drain_timeout_s: float) -> None:
    """A drafter's life after start: until SIGINT or SIGTERM, then let a draining scheduler's last steps finish,
    stop the server and close the node."""

    def stop() -> None:
        servicer.wait_until_quiet(drain_timeout_s)
        server.stop(grace=5).wait()
        if servicer.node is not None:
            servicer.node.close()

    wait_for_termination(stop)


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class NodeServicer:
    """The Worker gRPC service around a drafter or verifier node that loads in the background.

    Health is NOT_SERVING until the node has joined the world group and loaded its model. Steps run one
    at a time: the torch.distributed exchange at each step's end must stay in lockstep with the peer.
    """

    def __init__(self) -> None:
        self.node: WorkerNode | None = None
        self.load_error: BaseException | None = None
        self._health: health.HealthServicer | None = None
        self._lock = threading.Lock()
        self._running = 0  # steps running now
        self._count = threading.Lock()  # guards _running (a pool drafter runs steps side by side)
        self._last_step = time.monotonic()  # when the last step ended (a draining scheduler's steps stop)
        self._loader: threading.Thread | None = None

    def start_loading(self, load_node: Callable[[], WorkerNode], health_servicer: health.HealthServicer) -> None:
        """Join the world group and load the model in the background; flip health to SERVING when done."""
        self._health = health_servicer
        self._loader = threading.Thread(target=self._load, args=(load_node,), name="load-node", daemon=True)
        self._loader.start()

    def _load(self, load_node: Callable[[], WorkerNode]) -> None:
        try:
            self.node = load_node()
        except BaseException as exc:  # reported through health and every call
            self.load_error = exc
            log.exception("failed to start the worker node")
            return
        set_status(self._health, WORKER_SERVICE, serving=True)
        log.info("worker ready")

    def wait_until_quiet(self, timeout_s: float, quiet_s: float = 1.0) -> None:
        """On SIGTERM: let a draining scheduler finish, i.e. wait until no step has run for `quiet_s`
        (at most `timeout_s`), so that stopping this worker cuts off no request."""
        deadline = time.monotonic() + timeout_s
        while self.node is not None and time.monotonic() < deadline:
            if not self._running and time.monotonic() - self._last_step >= quiet_s:
                return
            time.sleep(0.1)

    def _ready_node(self, context: grpc.ServicerContext) -> WorkerNode:
        if self.node is None:
            detail = f"worker failed to start: {self.load_error}" if self.load_error else "worker is still loading"
            context.abort(grpc.StatusCode.UNAVAILABLE, detail)
        return self.node

    def Join(self, request, context):  # noqa: N802 (gRPC method name)
        """Form a new world; waits for a step still running in the old one (a dead peer's collective fails)."""
        node = self._ready_node(context)
        interrupt = getattr(node, "interrupt", None)  # a step waiting for a pool drafter's hand-over gives up
        if interrupt is not None:
            interrupt()
        with self._lock:
            try:
                node.join(request)
            except Exception as exc:
                log.exception("joining epoch %d failed", request.epoch)
                context.abort(grpc.StatusCode.UNAVAILABLE, f"joining epoch {request.epoch} failed: {exc}")
        log.info("joined epoch %d (%s)", request.epoch, "with the drafter" if request.has_drafter else "no drafter")
        return worker_pb2.JoinReply(epoch=request.epoch)

    def Step(self, request, context):  # noqa: N802 (gRPC method name)
        return self._run_step(self._ready_node(context), request, context)

    def Steps(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        """One stream per world: the next plan is here, already received, when a step ends."""
        node = self._ready_node(context)
        for plan in request_iterator:
            yield self._run_step(node, plan, context)

    def _run_step(self, node: WorkerNode, plan: worker_pb2.StepPlan, context) -> worker_pb2.StepReply:
        from minedraft.worker_node import NotInWorld

        with self._step_lock():
            start = time.monotonic()
            idle = start - self._last_step
            with self._count:
                self._running += 1
            try:
                reply = node.step(plan)
            except NotInWorld as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except Exception as exc:
                log.exception("step %d failed", plan.step_id)
                context.abort(grpc.StatusCode.INTERNAL, f"step {plan.step_id} failed: {exc}")
            finally:
                with self._count:
                    self._running -= 1
                self._last_step = time.monotonic()
            reply.compute_seconds = self._last_step - start
            reply.idle_seconds = idle
            return reply

    def _step_lock(self):
        """One step at a time (a pool drafter's servicer steps its groups side by side)."""
        return self._lock

    def Exchange(self, request, context):  # noqa: N802 (gRPC method name)
        """A pool drafter's or its verifier's half of a step's hand-over: kept for the step that waits for it."""
        from minedraft.worker_node import NotInWorld

        deliver = getattr(self._ready_node(context), "deliver", None)
        if deliver is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker is in its group's world: it takes "
                          "drafts and results over torch.distributed, not Exchange")  # fmt: skip
        try:
            deliver(request)
        except NotInWorld as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return worker_pb2.ExchangeReply()

    def GetWorkerInfo(self, request, context):  # noqa: N802
        return self._ready_node(context).info()
