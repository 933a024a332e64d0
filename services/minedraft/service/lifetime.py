"""A service process's life: it runs until SIGINT or SIGTERM, and a child dies with its parent, even when the
parent is SIGKILLed.

`minedraft up` starts the services as its children. A parent that is killed cannot stop them, so
each child arranges it itself, first thing after it starts: on Linux the kernel sends it SIGTERM when
its parent dies (prctl PR_SET_PDEATHSIG); elsewhere, and for a parent that died before prctl ran, a
watchdog thread in the child notices that its parent changed and sends itself SIGTERM. The child, not a
`preexec_fn`, calls prctl: a `preexec_fn` makes subprocess fork() the parent, and fork() runs gRPC's
at-fork handlers, which can deadlock a parent that runs gRPC threads. SIGTERM, not SIGKILL: a child still
shuts down in order (the scheduler drains, servers close their ports).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("minedraft")

PARENT_ENV = "MINEDRAFT_PARENT_PID"  # set by the parent: the pid its children watch
DEATH_SIGNAL_ENV = "MINEDRAFT_PARENT_DEATH_SIGNAL"  # set by a parent's main thread: the child asks for PDEATHSIG
_PR_SET_PDEATHSIG = 1


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
