"""How `minedraft up` keeps a stack's services running: `Supervisor` starts a service that exits again (with
back-off), and only one that crash-loops stops the stack. Its children die with it even when it is SIGKILLed
(`service.lifetime`: each child arranges that itself).
"""

from __future__ import annotations

import signal
import sys
import time
from collections import Counter, defaultdict, deque
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TextIO

if TYPE_CHECKING:
    from minedraft.settings import SupervisorSettings
    from minedraft.stack.fork_server import Process


class Supervised(Protocol):
    """A stack of services that `Supervisor` keeps running (`LocalStack`, `GatewayStack`)."""

    def processes(self) -> list[tuple[str, Process]]: ...

    def restart(self, name: str) -> Process: ...

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

    def _schedule(self, name: str, process: Process, now: float) -> bool:
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
