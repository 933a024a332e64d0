"""Chaos run against a running `minedraft up` (`minedraft bench --chaos`): load through the client SDK, with its
retries and resumption on, while `up`'s services are SIGKILLed one at a time, rotating over the roles; `up`
restarts what died, as the kubelet would. Reports requests lost, greedy outputs that differ from a first,
undisturbed pass over the same prompts (must be 0), throughput against that pass, and how long each kill took
to heal.

Healed means: a drafter or verifier is back in its group's world (both workers in the same epoch); a pool
drafter (`up --drafter-pool N`) serves a group again; a scheduler or the gateway serves again (health SERVING).
Linux only: `up` and its services are found in /proc.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from minedraft.api import worker_pb2, worker_pb2_grpc
from minedraft.bench import CHAOS_ROLES as ROLES
from minedraft.client import Client, RetryPolicy
from minedraft.service.health import is_serving

POOL = -2  # the "group" of a pool drafter, which serves them all
# Patient enough to outlast a restart (back-off, start, the group's re-formation) at every kill.
RETRIES = RetryPolicy(max_attempts=120, max_backoff=1.0)


@dataclass
class Kill:
    target: str  # drafter, verifier, scheduler or gateway (of group `group`)
    group: int  # -1: the gateway, POOL: a pool drafter
    at: float  # seconds into the chaos run
    recovered_after: float | None = None

    @property
    def name(self) -> str:
        if self.group == POOL:
            return f"pool {self.target}"
        return self.target if self.group < 0 else f"group {self.group} {self.target}"


@dataclass
class Run:
    """One pass: each request's prompt (its index), tokens or error; and how long the pass took."""

    prompts: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def throughput(self) -> float:
        return sum(map(len, self.token_ids)) / self.duration_s

    @property
    def lost(self) -> int:
        return sum(e is not None for e in self.errors)


@dataclass
class Load:
    """What the client sends: requests of token-id prompts (resumable), `concurrency` at a time; greedy, or with
    `temperature` above 0 sampled with each prompt's index as its seed (so both passes draw the same)."""

    address: str
    prompts: list[list[int]]
    concurrency: int
    max_tokens: int
    token: str | None = None
    temperature: float = 0.0


def run_load(load: Load, duration_s: float | None = None) -> Run:
    """Each prompt once, or round and round until `duration_s` has passed: what a client of the stack sees."""
    run, lock, next_index = Run(), threading.Lock(), iter(range(10**9))
    end = None if duration_s is None else time.monotonic() + duration_s

    def worker(client: Client) -> None:
        while True:
            with lock:
                i = next(next_index)
            if (end is None and i >= len(load.prompts)) or (end is not None and time.monotonic() >= end):
                return
            prompt = i % len(load.prompts)
            ids, error = _generate(client, load, prompt)
            with lock:
                run.prompts.append(prompt)
                run.token_ids.append(ids)
                run.errors.append(error)

    start = time.monotonic()
    client = Client(load.address, token=load.token, timeout=600, retries=RETRIES)
    with client, ThreadPoolExecutor(load.concurrency) as pool:
        for future in [pool.submit(worker, client) for _ in range(load.concurrency)]:
            future.result()
    run.duration_s = time.monotonic() - start
    return run


def _generate(client: Client, load: Load, prompt: int) -> tuple[list[int], str | None]:
    try:
        seed = {"seed": prompt} if load.temperature > 0 else {}
        completion = client.generate(load.prompts[prompt], max_tokens=load.max_tokens, temperature=load.temperature,
                                     ignore_eos=True, **seed)  # fmt: skip
        return completion.token_ids, None
    except grpc.RpcError as exc:
        return [], exc.code().name


@dataclass
class Service:
    role: str
    pid: int
    port: int
    group: int  # -1: the gateway, POOL: a pool drafter


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def _role(args: list[str]) -> str | None:
    """`minedraft <role> ...` (as `python -m minedraft` or the console script), or None."""
    for i, arg in enumerate(args[:-1]):
        if Path(arg).name == "minedraft":
            return args[i + 1]
    return None


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return found


def find_up(port: int) -> int:
    """The pid of the `minedraft up` on this machine that serves on `port`."""
    for proc in Path("/proc").glob("[0-9]*"):
        args = _cmdline(int(proc.name))
        if _role(args) == "up" and "--port" in args and args[args.index("--port") + 1] == str(port):
            return int(proc.name)
    raise LookupError(f"no `minedraft up --port {port}` runs on this machine: --chaos kills the services of a local "
                      "`minedraft up`, given as --target 127.0.0.1:PORT")  # fmt: skip


class Stack:
    """A running `minedraft up`: its services, found by their command lines."""

    def __init__(self, up_pid: int) -> None:
        self.up_pid = up_pid
        self.groups: dict[int, int] = {}  # scheduler port -> group index, in the order `up` started them

    def alive(self) -> bool:
        return Path(f"/proc/{self.up_pid}").exists()

    def services(self) -> list[Service]:
        found = []
        for pid in _children(self.up_pid):
            args = _cmdline(pid)
            role = _role(args)
            if role in ROLES and "--port" in args:
                found.append((role, pid, int(args[args.index("--port") + 1]), args))
        schedulers = sorted((pid, port, args) for role, pid, port, args in found if role == "scheduler")
        if not self.groups:
            self.groups = {port: i for i, (_, port, _) in enumerate(schedulers)}
        group_of: dict[int, int] = {}  # a group's service port -> its group
        for _, port, args in schedulers:
            group_of[port] = self.groups.get(port, -1)
            for role in ("verifier", "drafter"):
                address = args[args.index(f"--{role}") + 1] if f"--{role}" in args else ""
                if address:  # `--drafter ""`: the verifier drafts itself (colocated, `up`'s default on CPU)
                    group_of[int(address.rsplit(":", 1)[1])] = group_of[port]
        return [Service(role, pid, port, POOL if "--pool-groups" in args else
                        -1 if role == "gateway" else group_of.get(port, -1))
                for role, pid, port, args in found]  # fmt: skip

    def healed(self, killed: Service) -> bool:
        """The killed service's successor serves, and a worker is in its group's world again."""
        now = self.services()
        if not any(s.role == killed.role and s.port == killed.port and s.pid != killed.pid for s in now):
            return False
        if not _serving(killed.port):
            return False
        if killed.group == POOL:  # a group bound to it again
            return _info(killed.port).pool_groups > 0
        group = {s.role: s.port for s in now if s.group == killed.group}
        if killed.role not in ("drafter", "verifier") or "drafter" not in group:
            return True  # without a drafter, a verifier that serves is in the group as soon as it is formed
        verifier, drafter = _epoch(group["verifier"]), _epoch(group["drafter"])
        return verifier != 0 and verifier == drafter


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return is_serving(channel, timeout_s=1)


def _epoch(port: int) -> int:
    return _info(port).epoch


def _info(port: int) -> worker_pb2.WorkerInfo:
    """The worker's info (an empty one when it does not answer)."""
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            return stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=2)
    except grpc.RpcError:
        return worker_pb2.WorkerInfo()


def victims(stack: Stack, targets: list[str]) -> Callable[[], Service | None]:
    """The next service to kill: the roles in turn, each role's groups in turn (None: none of them runs)."""
    turn = iter(range(10**9))

    def pick() -> Service | None:
        services = stack.services()
        for _ in targets:
            n = next(turn)
            role = targets[n % len(targets)]
            candidates = sorted((s for s in services if s.role == role), key=lambda s: s.group)
            if candidates:
                return candidates[(n // len(targets)) % len(candidates)]
        return None

    return pick


def monkey(stack: Stack, stop: threading.Event, kills: list[Kill], every_s: float, targets: list[str],
           out: Callable[[str], None] = print) -> None:  # fmt: skip
    """Until `stop`: every `every_s`, SIGKILL the next target service and wait until it healed (a kill is
    always seen healed, or `up` gone, before this returns)."""
    start, pick = time.monotonic(), victims(stack, targets)
    while not stop.wait(max(0.0, every_s - (time.monotonic() - start) % every_s)):
        victim = pick()
        if victim is None:
            continue
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        kill = Kill(victim.role, victim.group, killed_at - start)
        kills.append(kill)
        out(f"  t={kill.at:5.1f}s  SIGKILL {kill.name}")
        while not stack.healed(victim):
            if not stack.alive():
                return
            time.sleep(0.05)
        kill.recovered_after = time.monotonic() - killed_at
        out(f"             healed after {kill.recovered_after:.1f}s")


@dataclass
class Chaos:
    every_s: float
    duration_s: float
    targets: list[str]


def run_chaos(stack: Stack, load: Load, chaos: Chaos, out: Callable[[str], None] = print) -> tuple[str, bool]:
    """An undisturbed pass, then the chaos pass; the report, and whether nothing was lost or changed."""
    sampling = f"sampled at temperature {load.temperature:g}, seeded" if load.temperature > 0 else "greedy"
    out(f"undisturbed pass: {len(load.prompts)} prompts x {load.max_tokens} tokens, concurrency {load.concurrency}, "
        f"{sampling}")
    run_load(Load(load.address, load.prompts[:2], 2, 8, load.token, load.temperature))  # warm-up
    calm = run_load(load)
    out(f"chaos pass: {chaos.duration_s:g}s, SIGKILL every {chaos.every_s:g}s, rotating "
        f"{'/'.join(chaos.targets)}; minedraft up restarts what died")  # fmt: skip
    kills: list[Kill] = []
    stop = threading.Event()
    failed: list[BaseException] = []

    def kill_in_turn() -> None:
        try:
            monkey(stack, stop, kills, chaos.every_s, chaos.targets, out)
        except BaseException as exc:  # a pass whose killer died is no chaos pass: raised below, not reported
            failed.append(exc)

    thread = threading.Thread(target=kill_in_turn)
    thread.start()
    try:
        wild = run_load(load, chaos.duration_s)
    finally:
        stop.set()
        thread.join()
    if failed:
        raise RuntimeError(f"the chaos pass stopped killing after {len(kills)} kills") from failed[0]
    changed = _changed(calm, wild)
    alive = stack.alive()
    return report(calm, wild, kills, alive, changed), alive and wild.lost == 0 and changed == 0


def _changed(calm: Run, wild: Run) -> int:
    expected = dict(zip(calm.prompts, calm.token_ids, strict=True))
    return sum(ids != expected[p] for p, ids, e in zip(wild.prompts, wild.token_ids, wild.errors, strict=True)
               if e is None)  # fmt: skip


def report(calm: Run, wild: Run, kills: list[Kill], alive: bool, changed: int) -> str:
    errors = Counter(e for e in wild.errors if e is not None)
    lines = [
        f"chaos pass:             {wild.duration_s:.0f}s, {len(kills)} kills {dict(Counter(k.name for k in kills))}",
        f"minedraft up:           {'still serving' if alive else 'STOPPED'}",
        f"requests lost:          {wild.lost} of {len(wild.errors)}" + (f" {dict(errors)}" if errors else ""),
        f"outputs != undisturbed: {changed} of {len(wild.errors) - wild.lost} completed",
        f"throughput:             {wild.throughput:.1f} tok/s vs {calm.throughput:.1f} undisturbed "
        f"({wild.throughput / calm.throughput:.2f}x)",
        "time to heal (kill -> the restarted service serves and is in its group again):",
    ]
    for target in sorted({k.target for k in kills}):
        times = [k.recovered_after for k in kills if k.target == target and k.recovered_after is not None]
        if times:
            lines.append(f"  {target:9s} {len(times)} kills: median {statistics.median(times):.1f}s, "
                         f"max {max(times):.1f}s")  # fmt: skip
    return "\n".join(lines)
