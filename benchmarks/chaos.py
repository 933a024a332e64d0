"""Chaos run against `minedraft up`: a load test while a random service is SIGKILLed every few seconds. This
script only kills; `up` restarts what died, as the kubelet would. Reports requests lost, greedy outputs that
differ from an undisturbed run of the same prompts (must be 0), throughput relative to that run, and how long
each kill took to heal.

    python benchmarks/chaos.py                                   # one group (MineDraft): drafter, verifier
    python benchmarks/chaos.py --engine-groups 2 --targets drafter,verifier,scheduler,gateway

Healed means: a drafter or verifier is back in its group's world (both workers in the same epoch); a
scheduler or the gateway serves again (health SERVING). Without
a gateway, a scheduler's kill fails its open streams (UNAVAILABLE, as in the cluster); the gateway's kill fails
the streams open through it; requests that had not started are retried by the SDK, as a client would.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from minedraft.api import worker_pb2, worker_pb2_grpc
from minedraft.bench.prompts import load_prompts
from minedraft.client import Client, RetryPolicy
from minedraft.launcher import free_port
from minedraft.serving import is_serving


@dataclass
class Kill:
    target: str  # drafter, verifier, scheduler or gateway (of group `group`)
    group: int
    at: float  # seconds into the chaos run
    recovered_after: float | None = None


@dataclass
class Run:
    """One pass over the prompts: each request's tokens, or its error; and how long the pass took."""

    token_ids: list[list[int]] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def throughput(self) -> float:
        return sum(map(len, self.token_ids)) / self.duration_s

    @property
    def lost(self) -> int:
        return sum(e is not None for e in self.errors)


def run_load(address: str, prompts: list[str], concurrency: int, max_tokens: int) -> Run:
    """Greedy requests, `concurrency` at a time, through the SDK with its retries (UNAVAILABLE before the first
    token, patient enough to outlast a restart): what a client of the cluster would see."""
    retries = RetryPolicy(max_attempts=60, max_backoff=1.0)

    def one(prompt: str) -> tuple[list[int], str | None]:
        try:
            return client.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True).token_ids, None
        except grpc.RpcError as exc:
            return [], exc.code().name

    run = Run()
    start = time.monotonic()
    with Client(address, timeout=600, retries=retries) as client, ThreadPoolExecutor(concurrency) as pool:
        for token_ids, error in pool.map(one, prompts):
            run.token_ids.append(token_ids)
            run.errors.append(error)
    run.duration_s = time.monotonic() - start
    return run


@dataclass
class Service:
    role: str
    pid: int
    port: int
    group: int  # -1: the gateway


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return found


_GROUPS: dict[int, int] = {}  # scheduler port -> group index, as `up` numbers them (the order it started them)


def services(up: subprocess.Popen) -> list[Service]:
    """The services `up` runs now, from their command lines."""
    found = []
    for pid in _children(up.pid):
        args = _cmdline(pid)
        if "minedraft" in args and "--port" in args:
            found.append((args[args.index("minedraft") + 1], pid, int(args[args.index("--port") + 1]), args))
    schedulers = sorted((pid, port, args) for role, pid, port, args in found if role == "scheduler")
    if not _GROUPS:
        _GROUPS.update({port: i for i, (_, port, _) in enumerate(schedulers)})
    group_of: dict[str, dict[int, int]] = {"scheduler": {}, "verifier": {}, "drafter": {}}
    for _, port, args in schedulers:
        i = group_of["scheduler"][port] = _GROUPS[port]
        for role in ("verifier", "drafter"):
            group_of[role][int(args[args.index(f"--{role}") + 1].rsplit(":", 1)[1])] = i
    return [Service(role, pid, port, group_of.get(role, {}).get(port, -1)) for role, pid, port, _ in found]


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return is_serving(channel, timeout_s=1)


def _epoch(port: int) -> int:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            return stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=2).epoch
    except grpc.RpcError:
        return 0


def healed(up: subprocess.Popen, killed: Service) -> bool:
    """The killed service's successor serves, and a worker is in its group's world again."""
    now = [s for s in services(up) if s.role == killed.role and s.port == killed.port and s.pid != killed.pid]
    if not now or not _serving(killed.port):
        return False
    if killed.role not in ("drafter", "verifier"):
        return True
    group = {s.role: s.port for s in services(up) if s.group == killed.group}
    if "drafter" not in group:
        return True  # no drafter in this mode: a verifier that serves is in the group as soon as it is formed
    verifier, drafter = _epoch(group["verifier"]), _epoch(group["drafter"])
    return verifier != 0 and verifier == drafter


def chaos(up: subprocess.Popen, stop: threading.Event, kills: list[Kill], every_s: float, targets: list[str],
          rng: random.Random) -> None:  # fmt: skip
    """Until `stop`: every `every_s`, SIGKILL a random target service and wait until it healed."""
    start = time.monotonic()
    while not stop.wait(max(0.0, every_s - (time.monotonic() - start) % every_s)):
        candidates = [s for s in services(up) if s.role in targets]
        if not candidates:
            continue
        victim = rng.choice(candidates)
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        kill = Kill(victim.role, victim.group, killed_at - start)
        kills.append(kill)
        print(f"  t={kill.at:5.1f}s  SIGKILL {_name(kill)}", flush=True)
        while not healed(up, victim):
            if stop.is_set() or up.poll() is not None:
                return
            time.sleep(0.05)
        kill.recovered_after = time.monotonic() - killed_at
        print(f"             healed after {kill.recovered_after:.1f}s", flush=True)


def _name(kill: Kill) -> str:
    return kill.target if kill.group < 0 else f"group {kill.group} {kill.target}"


def start_up(args: argparse.Namespace, log_dir: Path) -> tuple[subprocess.Popen, str]:
    """`minedraft up` with strict kernels (greedy output comparable), its restarts left at their defaults
    except the crash-loop limit (this run kills on purpose)."""
    port = free_port()
    command = [
        sys.executable, "-m", "minedraft", "up", "--port", str(port), "--metrics-port", "0", "--device", "cpu",
        "--batch-invariant", "--speculative-config", args.speculative_config, "--engine-groups",
        str(args.engine_groups), "--max-waiting-requests", str(4 * args.num_prompts), "--log-dir", str(log_dir),
        "--crash-loop-restarts", "1000",
    ]  # fmt: skip
    up = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = up.stdout.readline()
    if "is serving on" not in line:
        raise SystemExit(f"minedraft up did not start (service logs: {log_dir})")
    return up, f"127.0.0.1:{port}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--engine-groups", type=int, default=1)
    parser.add_argument("--kill-every", type=float, default=8.0, help="seconds between kills")
    parser.add_argument("--targets", default="drafter,verifier", help="services that may be killed: drafter, "
                        "verifier, scheduler, gateway")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speculative-config", default=json.dumps({"num_speculative_tokens": 4, "is_parallel": True}),
                        help="every group's speculative config (MineDraft by default)")  # fmt: skip
    args = parser.parse_args()

    prompts = load_prompts(limit=args.num_prompts)
    load = (prompts, args.concurrency, args.max_tokens)
    log_dir = Path(tempfile.mkdtemp(prefix="minedraft-chaos-"))
    print(f"service logs: {log_dir}", flush=True)
    up, address = start_up(args, log_dir)
    try:
        print(f"undisturbed run: {len(prompts)} prompts x {args.max_tokens} tokens, {args.engine_groups} group(s)",
              flush=True)  # fmt: skip
        run_load(address, prompts[:2], 2, 8)  # warm-up
        calm = run_load(address, *load)
        print(f"chaos run: a random {args.targets.replace(',', '/')} SIGKILLed every {args.kill_every:g}s; "
              "minedraft up restarts it", flush=True)  # fmt: skip
        kills: list[Kill] = []
        stop = threading.Event()
        monkey = threading.Thread(target=chaos, args=(up, stop, kills, args.kill_every, args.targets.split(","),
                                                      random.Random(args.seed)))  # fmt: skip
        monkey.start()
        try:
            wild = run_load(address, *load)
        finally:
            stop.set()
            monkey.join()
        alive = up.poll() is None
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)
    print(report(calm, wild, kills, alive))
    return 0 if alive else 1


def report(calm: Run, wild: Run, kills: list[Kill], alive: bool) -> str:
    done = [(a, b) for a, b, e in zip(calm.token_ids, wild.token_ids, wild.errors, strict=True) if e is None]
    errors = Counter(e for e in wild.errors if e is not None)
    lines = [
        f"chaos run:              {wild.duration_s:.0f}s, {len(kills)} kills {dict(Counter(map(_name, kills)))}",
        f"minedraft up:           {'still serving' if alive else 'STOPPED'}",
        f"requests lost:          {wild.lost} of {len(wild.errors)}" + (f" {dict(errors)}" if errors else ""),
        f"outputs != undisturbed: {sum(a != b for a, b in done)} of {len(done)} completed",
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


if __name__ == "__main__":
    raise SystemExit(main())
