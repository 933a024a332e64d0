"""Child processes that die with their parent, even when the parent is SIGKILLed.

`minedraft up` starts the services as its children. A parent that is killed cannot stop them, so
each child arranges it itself: on Linux the kernel sends it SIGTERM when its parent dies
(prctl PR_SET_PDEATHSIG); elsewhere, and for the moment before prctl runs, a watchdog thread in the
child notices that its parent changed and sends itself SIGTERM. SIGTERM, not SIGKILL: a child still
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

log = logging.getLogger("minedraft")

PARENT_ENV = "MINEDRAFT_PARENT_PID"  # set by the parent: the pid its children watch
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child (e.g. Popen's preexec_fn): SIGTERM when the parent thread that started it exits."""
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
    """Start the watchdog when the parent asked for it (PARENT_ENV names its pid)."""
    parent = os.environ.pop(PARENT_ENV, None)  # not inherited by processes this one starts
    if parent and parent.isdigit():
        watch_parent(int(parent))


def supervised_child() -> dict:
    """Popen arguments for a child that dies with this process. PR_SET_PDEATHSIG fires when the *thread*
    that started the child exits, so it is used only from the main thread; the watchdog covers the rest."""
    main = threading.current_thread() is threading.main_thread()
    return {
        "env": {**os.environ, PARENT_ENV: str(os.getpid())},
        "preexec_fn": die_with_parent if main else None,
        "start_new_session": True,  # a terminal's Ctrl-C reaches only the parent: it stops its children in order
    }
