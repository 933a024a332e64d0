"""Chaos run against `minedraft up`: a load test while a random service is SIGKILLed every few seconds. This
script only kills; `up` restarts what died, as the kubelet would. Reports requests lost, greedy outputs that
differ from an undisturbed run of the same prompts (must be 0), throughput relative to that run, and how long
each kill took to heal.

    python benchmarks/chaos.py                                   # one group (MineDraft): drafter, verifier
    python benchmarks/chaos.py --engine-groups 2 --targets drafter,verifier,scheduler,gateway

Healed means: a drafter or verifier is back in its group's world (both workers in the same epoch); a
scheduler or the gateway serves again (health SERVING). Without
a gateway, a scheduler's kill fails its open streams (UNAVAILABLE, as in the cluster); the gateway's kill fails
the streams open through it and refuses requests until it is back (the bench client does not retry).
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
from dataclasses import dataclass
from pathlib import Path

import grpc

from minedraft.api import worker_pb2, worker_pb2_grpc
from minedraft.bench.online import BenchResult, run_online_bench
from minedraft.bench.prompts import load_prompts
from minedraft.launcher import free_port
from minedraft.serving import is_serving


@dataclass
class Kill:
    target: str  # drafter, verifier, scheduler or gateway (of group `group`)
    group: int
    at: float  # seconds into the chaos run
    recovered_after: float | None = None


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


def services(up: subprocess.Popen) -> list[Service]:
    """The services `up` runs now, from their command lines; a group is numbered by its scheduler's port order."""
    found = []
    for pid in _children(up.pid):
        args = _cmdline(pid)
        if "minedraft" in args and "--port" in args:
            found.append((args[args.index("minedraft") + 1], pid, int(args[args.index("--port") + 1]), args))
    schedulers = sorted((port, args) for role, _, port, args in found if role == "scheduler")
    group_of = {"scheduler": {}, "verifier": {}, "drafter": {}}
    for i, (port, args) in enumerate(schedulers):
        group_of["scheduler"][port] = i
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
    load = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "timeout": 900.0, "warmup": 2, "progress": False}  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="minedraft-chaos-"))
    print(f"service logs: {log_dir}", flush=True)
    up, address = start_up(args, log_dir)
    try:
        print(f"undisturbed run: {len(prompts)} prompts x {args.max_tokens} tokens, {args.engine_groups} group(s)",
              flush=True)  # fmt: skip
        calm = run_online_bench(address, prompts, **load)
        print(f"chaos run: a random {args.targets.replace(',', '/')} SIGKILLed every {args.kill_every:g}s; "
              "minedraft up restarts it", flush=True)  # fmt: skip
        kills: list[Kill] = []
        stop = threading.Event()
        monkey = threading.Thread(target=chaos, args=(up, stop, kills, args.kill_every, args.targets.split(","),
                                                      random.Random(args.seed)))  # fmt: skip
        monkey.start()
        try:
            wild = run_online_bench(address, prompts, **{**load, "warmup": 0})
        finally:
            stop.set()
            monkey.join()
        alive = up.poll() is None
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)
    print(report(calm, wild, kills, alive))
    return 0 if alive else 1


def report(calm: BenchResult, wild: BenchResult, kills: list[Kill], alive: bool) -> str:
    done = [(a, b) for a, b in zip(calm.records, wild.records, strict=True) if b.error is None]
    differ = sum(a.token_ids != b.token_ids for a, b in done)
    errors = Counter((r.error or "").split(":")[0] for r in wild.records if r.error is not None)
    lines = [
        f"chaos run:              {wild.duration_s:.0f}s, {len(kills)} kills "
        f"{dict(Counter(_name(k) for k in kills))}",
        f"minedraft up:           {'still serving' if alive else 'STOPPED'}",
        f"requests lost:          {wild.failed} of {len(wild.records)}" + (f" {dict(errors)}" if errors else ""),
        f"outputs != undisturbed: {differ} of {len(done)} completed",
        f"throughput:             {wild.output_throughput:.1f} tok/s vs {calm.output_throughput:.1f} undisturbed "
        f"({wild.output_throughput / calm.output_throughput:.2f}x)",
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
