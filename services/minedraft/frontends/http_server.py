"""The OpenAI HTTP API's server: uvicorn as one task in the event loop of the process that serves gRPC too
(the scheduler, the gateway)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from fastapi import FastAPI

from minedraft.settings import ListenError

log = logging.getLogger("minedraft")


class _EmbeddedUvicorn(uvicorn.Server):
    """The service owns SIGINT/SIGTERM, not uvicorn."""

    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    """A started HTTP server; `stop(graceful=True)` lets open responses (streams) finish first."""

    def __init__(self, server: _EmbeddedUvicorn, task: asyncio.Task) -> None:
        self._server, self._task = server, task

    def stop_accepting(self) -> None:
        self._server.should_exit = True  # uvicorn's graceful exit: no new connections, open responses go on

    async def stop(self) -> None:
        self._server.force_exit = True
        await self._task


async def start_http(app: FastAPI, host: str, port: int, tls: tuple[str, str] | None) -> HttpServer:
    """Serve `app` on host:port (`tls`: cert and key PEM paths); ListenError naming --http-port if the port
    cannot be had."""
    config = uvicorn.Config(
        app, host=host, port=port, ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None,
        lifespan="off", access_log=False, log_level="warning",
    )  # fmt: skip
    server = _EmbeddedUvicorn(config)
    sock = _listen("--http-port", host, port)  # ours: uvicorn would sys.exit on a taken port
    task = asyncio.create_task(server.serve(sockets=[sock]), name="openai-http")
    while not server.started:
        if task.done():
            task.result()
            raise OSError(f"the HTTP server on {host}:{port} stopped while starting")
        await asyncio.sleep(0.05)
    log.info("OpenAI HTTP API on %s://%s:%d", "https" if tls else "http", host, port)
    return HttpServer(server, task)


def _listen(flag: str, host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family)
        # Accepted connections inherit this. asyncio sets it only on sockets whose proto is TCP, and
        # create_server's is 0: without it, Nagle held each response's first event until the client's
        # delayed ACK (about 40 ms more TTFT on every reused keep-alive connection).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    except OSError as exc:
        raise ListenError(flag, f"{host}:{port}", exc.strerror or str(exc)) from exc


async def stop_http(http: HttpServer | None) -> None:
    if http is not None:
        await http.stop()
