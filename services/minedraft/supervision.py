"""Child processes that die with their parent, even when the parent is SIGKILLed.

`minedraft up` starts the services as its children. A parent that is killed cannot stop them, so
each child arranges it itself, first thing after it starts: on Linux the kernel sends it SIGTERM when
its parent dies (prctl PR_SET_PDEATHSIG); elsewhere, and for a parent that died before prctl ran, a
watchdog thread in the child notices that its parent changed and sends itself SIGTERM. The child, not a
`preexec_fn`, calls prctl: a `preexec_fn` makes subprocess fork() the parent, and fork() runs gRPC's
at-fork handlers, which can deadlock a parent that runs gRPC threads. SIGTERM, not SIGKILL: a child still
shuts down in order (the scheduler drains, servers close their ports).

`Supervisor` keeps a stack's services running: a service that exits is started again (with back-off),
and only one that crash-loops stops the stack.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict, deque
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TextIO

if TYPE_CHECKING:
    from minedraft.settings import SupervisorSettings

log = logging.getLogger("minedraft")

PARENT_ENV = "MINEDRAFT_PARENT_PID"  # set by the parent: the pid its children watch
DEATH_SIGNAL_ENV = "MINEDRAFT_PARENT_DEATH_SIGNAL"  # set by a parent's main thread: the child asks for PDEATHSIG
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child: SIGTERM when the parent thread that started it exits."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def watch_parent(parent_pid: int, interval_s: float = 1.0) -> threading.Thread:
    """A daemon thread that sends this process SIGTERM once `parent_pid` is no longer its parent."""

    def loop() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        log.warning("parent process %d is gone: stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=loop, name="parent-watchdog", daemon=True)
    thread.start()
    return thread


def watch_parent_from_env() -> None:
    """Die with the parent when it asked for it (PARENT_ENV names its pid): the kernel's death signal where
    the parent's main thread started this process, and the watchdog always."""
    parent = os.environ.pop(PARENT_ENV, None)  # neither is inherited by processes this one starts
    death_signal = os.environ.pop(DEATH_SIGNAL_ENV, None) == "1"
    if not (parent and parent.isdigit()):
        return
    if death_signal:
        die_with_parent()
    watch_parent(int(parent))  # also covers a parent that died before prctl ran


def supervised_child() -> dict:
    """Popen arguments for a `minedraft` child that dies with this process (see `watch_parent_from_env`).
    PR_SET_PDEATHSIG fires when the *thread* that started the child exits, so it is asked for only by
    children of the main thread; the watchdog covers the rest."""
    main = threading.current_thread() is threading.main_thread()
    return {
        "env": {**os.environ, PARENT_ENV: str(os.getpid()), DEATH_SIGNAL_ENV: "1" if main else "0"},
        "start_new_session": True,  # a terminal's Ctrl-C reaches only the parent: it stops its children in order
    }


class Supervised(Protocol):
    """A stack of services that `Supervisor` keeps running (`LocalStack`, `GatewayStack`)."""

    def processes(self) -> list[tuple[str, subprocess.Popen]]: ...

    def restart(self, name: str) -> subprocess.Popen: ...

    def log_path(self, name: str) -> Path | None: ...


def exit_status(code: int) -> str:
    """How a process ended, from its return code (negative: the signal that killed it)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:  # a signal without a name (real-time signals)
        return f"was killed by signal {-code}"


class Supervisor:
    """Restart each service that exits with its unchanged command, as the kubelet restarts a container.

    The back-off before a restart is 1 s, doubled for each restart of that service within the crash-loop
    window, capped at `restart_backoff_max`. A service that exits again after `crash_loop_restarts` restarts
    within the window crash-loops (Kubernetes' CrashLoopBackOff): `run` names it and returns 1.
    """

    def __init__(self, stack: Supervised, settings: SupervisorSettings, out: TextIO | None = None) -> None:
        self.stack = stack
        self.settings = settings
        self._out = out or sys.stderr
        self._recent: dict[str, deque[float]] = defaultdict(deque)  # restart times within the window
        self._due: dict[str, float] = {}  # services waiting out their back-off: when to start them
        self.restarts: Counter[str] = Counter()

    def run(self, poll_s: float = 0.2) -> int:
        """Until Ctrl-C / SIGTERM (KeyboardInterrupt): 0, or a crash loop: 1. Prints a summary either way."""
        try:
            while (code := self.poll()) is None:
                time.sleep(poll_s)
            return code
        except KeyboardInterrupt:
            return 0
        finally:
            self._say(self.summary())

    def poll(self) -> int | None:
        """Schedule a restart for each service that exited, start those whose back-off is over; 1 on a crash loop."""
        now = time.monotonic()
        for name, process in self.stack.processes():
            if name not in self._due and process.poll() is not None and not self._schedule(name, process, now):
                return 1
        for name in [n for n, due in self._due.items() if due <= now]:
            del self._due[name]
            self._recent[name].append(now)
            self.restarts[name] += 1
            self.stack.restart(name)
        return None

    def _schedule(self, name: str, process: subprocess.Popen, now: float) -> bool:
        """A restart after the back-off; False (and the line that says why) if the service crash-loops."""
        recent = self._recent[name]
        while recent and now - recent[0] > self.settings.crash_loop_window:
            recent.popleft()
        how = exit_status(process.returncode)
        if len(recent) >= self.settings.crash_loop_restarts:
            log = self.stack.log_path(name)
            where = f"see {log}" if log else "its output is above"
            self._say(f"the {name} {how} after {len(recent)} restarts in {self.settings.crash_loop_window:g}s "
                      f"(--crash-loop-restarts {self.settings.crash_loop_restarts}): it crash-loops, {where}; "
                      "stopping every service")  # fmt: skip
            return False
        delay = min(self.settings.restart_backoff_max, 2.0 ** len(recent))
        self._due[name] = now + delay
        self._say(f"the {name} {how}; restarting it in {delay:g}s (restart {self.restarts[name] + 1})")
        return True

    def summary(self) -> str:
        if not self.restarts:
            return "no service was restarted"
        return "restarts: " + ", ".join(f"{name} {count}" for name, count in sorted(self.restarts.items()))

    def _say(self, line: str) -> None:
        print(f"minedraft up: {line}", file=self._out, flush=True)
