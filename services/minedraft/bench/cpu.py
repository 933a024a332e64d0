"""CPU seconds of processes (user + system, every thread), read from Linux's /proc: where a benchmark's CPU
went. Each figure is a total so far; a run's share is the difference of two readings."""

from __future__ import annotations

import os
from pathlib import Path


def _stat(pid: int) -> tuple[int, float]:
    """(parent pid, CPU seconds) of `pid`. The fields after the command name, which may hold spaces."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds `pid` has used so far."""
    return _stat(pid)[1]


def tree_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds of `root` and its descendants, summed by process label: `minedraft <role>` for our
    services, else the process name."""
    stats = {}
    for path in Path("/proc").glob("[0-9]*"):
        try:
            stats[int(path.name)] = _stat(int(path.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    tree, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, (ppid, _) in stats.items() if ppid in frontier and pid not in tree]
        tree.update(children)
        frontier = children
    used: dict[str, float] = {}
    for pid in tree & stats.keys():
        label = _label(pid)
        used[label] = used.get(label, 0.0) + stats[pid][1]
    return used


def _label(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv[:4]]
    role = next((w for w in ("scheduler", "verifier", "drafter", "up") if w in words), None)
    return f"minedraft {role}" if "minedraft" in words and role else comm
