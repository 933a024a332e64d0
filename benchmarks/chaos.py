"""Chaos run: a load test while a random worker is SIGKILLed every few seconds and restarted, as
Kubernetes restarts a pod. Reports requests lost (must be 0), greedy outputs that differ from an
undisturbed run of the same prompts (must be 0), throughput relative to that run, and how long the group
took to be whole again after each kill.

    python benchmarks/chaos.py                       # bundled pair, MineDraft, strict kernels
    python benchmarks/chaos.py --kill-every 5 --num-prompts 128 --targets drafter
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from minedraft.api import worker_pb2, worker_pb2_grpc
from minedraft.bench.online import BenchResult, run_online_bench
from minedraft.bench.prompts import load_prompts
from minedraft.config import EngineConfig
from minedraft.launcher import LocalStack, scheduler_settings


@dataclass
class Kill:
    worker: str
    at: float  # seconds into the chaos run
    recovered_after: float | None = None  # kill -> the restarted worker is in the scheduler's world again


def _epoch(address: str) -> int:
    try:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            return stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=2).epoch
    except grpc.RpcError:
        return 0


def _whole(stack: LocalStack) -> bool:
    """Both workers are in the same world (the scheduler formed it with the restarted one)."""
    verifier, drafter = _epoch(stack.verifier_address), _epoch(stack.drafter_address)
    return verifier != 0 and verifier == drafter


def chaos(stack: LocalStack, stop: threading.Event, kills: list[Kill], every_s: float, restart_after_s: float,
          targets: list[str], rng: random.Random) -> None:
    """Until `stop`: wait, SIGKILL a random worker, restart it after a pause, wait until the group is whole."""
    start = time.monotonic()
    while not stop.wait(every_s):
        kill = Kill(rng.choice(targets), time.monotonic() - start)
        killed_at = time.monotonic()
        process = stack.process(kill.worker)
        process.kill()
        process.wait()
        kills.append(kill)
        print(f"  t={kill.at:5.1f}s  SIGKILL {kill.worker}", flush=True)
        time.sleep(restart_after_s)
        stack.restart(kill.worker)
        while not _whole(stack):
            if stop.is_set():
                return
            time.sleep(0.05)
        kill.recovered_after = time.monotonic() - killed_at
        print(f"             group whole again after {kill.recovered_after:.1f}s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kill-every", type=float, default=8.0, help="seconds between kills")
    parser.add_argument("--restart-after", type=float, default=1.0, help="seconds a killed worker stays down")
    parser.add_argument("--targets", default="drafter,verifier", help="workers that may be killed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--speculative-config", default='{"num_speculative_tokens": 4, "is_parallel": true}',
        help="the group's speculative config (MineDraft by default)",
    )  # fmt: skip
    args = parser.parse_args()

    config = EngineConfig(speculative_config=args.speculative_config, device="cpu", batch_invariant=True)
    prompts = load_prompts(limit=args.num_prompts)
    load = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "timeout": 900.0, "warmup": 2}  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="minedraft-chaos-"))
    print(f"service logs: {log_dir}", flush=True)
    settings = scheduler_settings(max_waiting_requests=4 * args.num_prompts)
    with LocalStack(config, scheduler=settings, log_dir=log_dir) as stack:
        print(f"undisturbed run: {len(prompts)} prompts x {args.max_tokens} tokens", flush=True)
        calm = run_online_bench(stack.address, prompts, **load)
        print(f"chaos run: a random worker of {args.targets} killed every {args.kill_every:.0f}s", flush=True)
        kills: list[Kill] = []
        stop = threading.Event()
        monkey = threading.Thread(
            target=chaos,
            args=(stack, stop, kills, args.kill_every, args.restart_after, args.targets.split(","),
                  random.Random(args.seed)),
        )  # fmt: skip
        monkey.start()
        try:
            wild = run_online_bench(stack.address, prompts, **{**load, "warmup": 0})
        finally:
            stop.set()
            monkey.join()
    print(report(calm, wild, kills))
    return 0 if wild.failed == 0 else 1


def report(calm: BenchResult, wild: BenchResult, kills: list[Kill]) -> str:
    differ = sum(a.token_ids != b.token_ids for a, b in zip(calm.records, wild.records) if b.error is None)
    recovered = [k.recovered_after for k in kills if k.recovered_after is not None]
    by_worker = {w: sum(k.worker == w for k in kills) for w in sorted({k.worker for k in kills})}
    lost = f"{wild.failed} of {len(wild.records)}" + (f" ({wild.first_error})" if wild.failed else "")
    lines = [
        f"kills:                 {len(kills)} {by_worker}",
        f"requests lost:         {lost}",
        f"outputs != undisturbed: {differ}",
        f"throughput:            {wild.output_throughput:.1f} tok/s vs {calm.output_throughput:.1f} undisturbed "
        f"({wild.output_throughput / calm.output_throughput:.2f}x)",
    ]
    if recovered:
        lines.append(f"time to recover:       median {statistics.median(recovered):.1f}s, max {max(recovered):.1f}s "
                     "(kill -> the restarted worker is in the group again)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
