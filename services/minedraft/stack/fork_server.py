"""Start a local stack's services by forking a warm process instead of starting fresh interpreters.

Every service of a CPU stack starts by importing the interpreter's world (torch, grpc, pydantic, our own
modules), which is most of a toy service's start-up (docs/design.md, "Testing"). A fork server is one
process, started once per launcher and environment, that has done those imports and forks each service from
there. A forked service then runs `minedraft <args>` exactly as `python -m minedraft <args>` would, and is a
real process with its own pid that the launcher signals directly; its exit status comes back over a pipe,
since only the fork server can wait for it.

What a fresh interpreter would read from its environment at start-up (OpenMP's variables, PYTHONPATH, ...)
the fork server read at its own: so services whose environments differ other than in `_RUN_TIME_VARIABLES`
get fork servers of their own. The fork server has started no thread pool and no gRPC channel when it
forks (both are unsafe across fork). It dies with its launcher, and its services die with it
(`service.lifetime`).

Off unless a launcher calls `enable()` (the test suite does, for the hundreds of stacks it starts): a forked
service's command line in `ps` is the fork server's, and it is the fork server's child, not the launcher's, so
`minedraft up` starts fresh interpreters, which show what they run. Used for CPU stacks on Linux only.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NoReturn

from minedraft.frontends.auth import API_KEYS_ENV
from minedraft.service.lifetime import DEATH_SIGNAL_ENV, PARENT_ENV, supervised_child, watch_parent_from_env
from minedraft.settings import BACKEND_API_KEY_ENV

# Variables read only once a service runs (or applied by the fork server as it forks): services that differ in
# these alone share a fork server.
_RUN_TIME_VARIABLES = {PARENT_ENV, DEATH_SIGNAL_ENV, API_KEYS_ENV, BACKEND_API_KEY_ENV, "OMP_NUM_THREADS"}
# What the services import before they serve: the fork server imports it once for all of them.
_PRELOADED = ("torch", "grpc", "minedraft.cli.serve", "minedraft.worker.verifier", "minedraft.worker.drafter",
              "minedraft.pool.service", "minedraft.scheduler.server", "minedraft.gateway.service",
              "minedraft.engine.local_executor")  # fmt: skip
_MAX_SERVERS = 8  # environments beyond these start their services fresh
_PREFIX = [sys.executable, "-m", "minedraft"]


def launch_service(command: list[str], env: dict[str, str], log: Path | None, *, forkable: bool) -> Process:
    """Start `command` (a `python -m minedraft ...` line) as a service that dies with this process, logging to
    `log` (None: to this process's stdout and stderr). `forkable`: it may be forked from a fork server (its
    stack runs on CPU)."""
    options = supervised_child()
    env = {**env, **{k: options["env"][k] for k in (PARENT_ENV, DEATH_SIGNAL_ENV)}}
    if forkable and _enabled and command[:3] == _PREFIX:
        server = _server_for(env)
        if server is not None:
            if log:
                log.open("a").close()  # a log that cannot be opened fails here, in the launcher, as below
            return server.fork(command, env, log)
    out = open(log, "a") if log else None  # noqa: SIM115 (the child holds it; ours closes with the Popen)
    return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=options["start_new_session"])  # fmt: skip


_enabled = False
_ignored: frozenset[str] = frozenset()  # the launcher's own run-time variables (enable)


def enable(enabled: bool = True, run_time_variables: tuple[str, ...] = ()) -> None:
    """Fork this process's CPU stacks' services from fork servers from now on (or, False, no longer).
    `run_time_variables`: the launcher's variables that no service reads at start-up and that change while it
    runs (a test runner's name of the current test): services that differ in these alone share a fork server."""
    global _enabled, _ignored
    _enabled = enabled and sys.platform.startswith("linux")
    _ignored = frozenset(run_time_variables)


_SERVERS: dict[tuple, ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def _server_for(env: dict[str, str]) -> ForkServer | None:
    """This environment's fork server, started on first use (None: too many environments already)."""
    ignored = _RUN_TIME_VARIABLES | _ignored
    key = (os.getcwd(), *sorted((k, v) for k, v in env.items() if k not in ignored))
    with _SERVERS_LOCK:
        for gone in [k for k, server in _SERVERS.items() if not server.alive]:
            del _SERVERS[gone]
        if key not in _SERVERS:
            if len(_SERVERS) >= _MAX_SERVERS:
                return None
            _SERVERS[key] = ForkServer(env)
        return _SERVERS[key]


class ForkedProcess:
    """A service forked by a fork server, with the part of `subprocess.Popen` that stacks and tests use."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.pid, self.args, self._server = pid, args, server
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout_s=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout_s=timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that may already belong to another process
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Process = subprocess.Popen | ForkedProcess  # what a stack holds of each service it started


class ForkServer:
    """The launcher's end of one fork server: requests go down one pipe, pids and exit statuses come up another,
    read by a thread that records each exit."""

    def __init__(self, env: dict[str, str]) -> None:
        requests_read, self._requests = os.pipe()
        self._replies, replies_write = os.pipe()
        env = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}  # each service sets its own
        self.process = subprocess.Popen(
            [*_PREFIX[:2], __name__, str(requests_read), str(replies_write)], env=env,
            pass_fds=(requests_read, replies_write), start_new_session=True,
        )  # fmt: skip
        os.close(requests_read)
        os.close(replies_write)
        self._lock = threading.Lock()  # one fork request at a time
        self._changed = threading.Condition()
        self._exits: dict[int, int] = {}
        self._answers: list[dict] = []  # each fork request's pid (or error), in order
        self.alive = True
        threading.Thread(target=self._read_replies, name="fork-server-replies", daemon=True).start()

    def fork(self, command: list[str], env: dict[str, str], log: Path | None) -> ForkedProcess:
        request = {"args": command[3:], "env": env, "log": str(log) if log else None}
        with self._lock, self._changed:
            os.write(self._requests, json.dumps(request).encode() + b"\n")
            self._changed.wait_for(lambda: self._answers or not self.alive)
            if not self._answers:
                raise OSError(f"the fork server (pid {self.process.pid}) exited with code {self.process.wait()}")
            answer = self._answers.pop(0)
        if "error" in answer:
            raise OSError(f"the fork server could not fork `minedraft {command[3]}`: {answer['error']}")
        return ForkedProcess(self, answer["pid"], command)

    def exit_code(self, pid: int, timeout_s: float | None) -> int | None:
        """The service's exit status as Popen reports it (-N: killed by signal N), once it has exited."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or not self.alive, timeout=timeout_s)
        while pid not in self._exits and not self.alive:  # nobody is left to report: watch it end
            if not _running(pid):
                self._exits[pid] = -signal.SIGTERM  # the death signal the fork server's end sent it
            elif deadline is not None and time.monotonic() >= deadline:
                break
            else:
                time.sleep(0.05)
        return self._exits.get(pid)

    def _read_replies(self) -> None:
        buffered = b""
        while chunk := os.read(self._replies, 65536):
            *lines, buffered = (buffered + chunk).split(b"\n")
            with self._changed:
                for reply in map(json.loads, lines):
                    if "exited" in reply:
                        self._exits[reply["exited"]] = reply["code"]
                    else:
                        self._answers.append(reply)
                self._changed.notify_all()
        with self._changed:
            self.alive = False
            self._changed.notify_all()


def _running(pid: int) -> bool:
    """Whether `pid` runs (an exited child whose parent has not reaped it yet is a zombie: it does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _serve(requests: int, replies: int) -> dict:
    """The fork server's loop: fork a service per request and report each one's exit. Returns only in a forked
    child, with the request that child is to run."""
    watch_parent_from_env()
    for name in _PRELOADED:
        importlib.import_module(name)
    gc.freeze()  # the imported world stays shared with the services instead of copied as the collector walks it
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's exit wakes the select below
    buffered = b""
    while True:
        readable, _, _ = select.select([requests, wake_read], [], [])
        if wake_read in readable:
            while _drained(wake_read):
                pass
            _report_exits(replies)
        if requests in readable:
            chunk = os.read(requests, 1 << 20)
            if not chunk:
                sys.exit(0)  # the launcher is gone; the death signal ends our services
            *lines, buffered = (buffered + chunk).split(b"\n")
            for request in map(json.loads, lines):
                sys.stdout.flush()
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as exc:
                    _reply(replies, {"error": str(exc)})
                    continue
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (requests, replies, wake_read, wake_write):
                        os.close(fd)
                    return request
                _reply(replies, {"pid": pid})


def _drained(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _report_exits(replies: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply(replies, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _reply(replies: int, message: dict) -> None:
    os.write(replies, json.dumps(message).encode() + b"\n")


def _run_service(args: list[str]) -> NoReturn:
    """In a forked child: run `minedraft <args>` and exit as the interpreter would, but without tearing down the
    world it inherited: that would touch, and so copy, every page the fork server shares with its services
    (a quarter of a second per service on two cores). multiprocessing ends its forked children the same way."""
    from minedraft.cli import main

    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    if not isinstance(code, int | None):  # sys.exit("message"): the message on stderr, status 1
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()  # logging's flush and whatever the service registered
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _become_service(request: dict, default_threads: int) -> list[str]:
    """In a forked child: take the service's session, log, environment and threads, as a fresh interpreter
    started with them would have; returns its `minedraft` arguments."""
    import torch

    os.setsid()
    if request["log"]:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update({PARENT_ENV: str(os.getppid()), DEATH_SIGNAL_ENV: "1"})  # forked by our main thread
    random.seed()  # as a fresh interpreter's: not the state every sibling shares
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or default_threads))
    sys.argv = [sys.argv[0], *request["args"]]
    return request["args"]


if __name__ == "__main__":
    import torch

    threads = torch.get_num_threads()
    _run_service(_become_service(_serve(int(sys.argv[1]), int(sys.argv[2])), threads))
