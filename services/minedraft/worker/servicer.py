"""The Worker gRPC service around a drafter or verifier node (worker/node.py), its server, and a worker's life
until it is stopped. (The plumbing every service shares is in `service/`.)"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health

from minedraft.api import worker_pb2, worker_pb2_grpc
from minedraft.service.grpc_server import WORKER_SERVICE, add_health_and_reflection, grpc_options, listen
from minedraft.service.health import set_status
from minedraft.service.lifetime import wait_for_termination
from minedraft.worker.node import NotInWorld, WorkerNode

log = logging.getLogger("minedraft")


def start_worker_server(
    servicer, host: str, port: int, max_workers: int = 8
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """Start a threaded gRPC server for a drafter or verifier; health starts as NOT_SERVING."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=grpc_options(server=True))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    set_status(health_servicer, WORKER_SERVICE, serving=False)
    add_health_and_reflection(server, health_servicer, WORKER_SERVICE)
    bound = listen(server, f"{host}:{port}", "--port")
    server.start()
    return server, health_servicer, bound


def serve_until_stopped(servicer: NodeServicer, server: grpc.Server, drain_timeout_s: float) -> None:
    """A drafter's life after start: until SIGINT or SIGTERM, then let a draining scheduler's last steps finish,
    stop the server and close the node."""

    def stop() -> None:
        servicer.wait_until_quiet(drain_timeout_s)
        server.stop(grace=5).wait()
        if servicer.node is not None:
            servicer.node.close()

    wait_for_termination(stop)


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
