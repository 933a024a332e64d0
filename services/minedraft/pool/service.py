"""`minedraft drafter --pool-groups N`: a pool drafter behind the Worker gRPC API."""

from __future__ import annotations

import contextlib
import logging

import grpc

from minedraft.api import worker_pb2
from minedraft.config import EngineConfig
from minedraft.pool.member import PoolFull, PoolMember
from minedraft.settings import WorkerSettings
from minedraft.worker.servicer import NodeServicer, serve_until_stopped, start_worker_server

log = logging.getLogger("minedraft.pool")


class PoolServicer(NodeServicer):
    """Steps of different groups run side by side (the member locks its model itself); a group's world ends
    with its step stream."""

    def _step_lock(self):
        return contextlib.nullcontext()

    def Join(self, request, context):  # noqa: N802 (gRPC method name)
        node = self._ready_node(context)
        try:
            node.join(request)
        except PoolFull as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.JoinReply(epoch=request.epoch)

    def Steps(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        node = self._ready_node(context)
        epoch = None
        try:
            for plan in request_iterator:
                epoch = plan.epoch
                yield self._run_step(node, plan, context)
        finally:
            if epoch is not None:
                node.leave(epoch)


def serve_pool_drafter(config: EngineConfig, groups: int, settings: WorkerSettings, host: str, port: int) -> None:
    """Serve up to `groups` engine groups until stopped. Each group's steps, its Exchange calls and a health check
    may run at once: the server gets threads for all of them."""
    servicer = PoolServicer()
    server, health, bound = start_worker_server(servicer, host, port, max_workers=4 * groups + 8)
    servicer.start_loading(lambda: PoolMember(config, groups, settings.dist_timeout), health)
    log.info("pool drafter listening on %s:%d, for up to %d engine groups", host, bound, groups)

    serve_until_stopped(servicer, server, settings.step_drain_timeout)
