"""Thread placement of `minedraft up` on a shared CPU: the same served mode under different environments.

Each variant is a set of environment variables given to one stack's processes (the launcher passes its
environment on; `OMP_NUM_THREADS` set here overrides the launcher's own choice, `threads_per_worker`).
The stacks run side by side and the rounds interleave them, so each variant sees the same machine.

    python benchmarks/placement.py --mode ar "" OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
    python benchmarks/placement.py --mode minedraft "" OMP_NUM_THREADS=2 --rounds 5

"" is the default placement. Prints each variant's tok/s (median of the rounds) and the scheduler's CPU
seconds per 1,000 output tokens (Linux, from /proc).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from minedraft.bench.offline import mode_configs
from minedraft.bench.online import run_online_bench
from minedraft.bench.prompts import load_prompts
from minedraft.config import EngineConfig
from minedraft.launcher import LocalStack, scheduler_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help='comma-separated NAME=VALUE assignments per stack; "" is none')
    parser.add_argument("--mode", default="ar", choices=["ar", "sd", "pearl", "minedraft"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    prompts = load_prompts(limit=args.num_prompts)
    overlapped = args.mode in ("pearl", "minedraft")  # two batches of half the requests
    config = EngineConfig(device="cpu", max_num_seqs=args.concurrency // (2 if overlapped else 1),
                          speculative_config=mode_configs({"num_speculative_tokens": args.k})[args.mode])  # fmt: skip
    throughput: dict[str, list[float]] = {}
    scheduler_cpu: dict[str, list[float]] = {}
    with ExitStack() as running, tempfile.TemporaryDirectory() as logs:
        stacks = {}
        for index, variant in enumerate(args.variants):
            log_dir = Path(logs) / str(index)
            log_dir.mkdir()
            with _environment(variant):
                stacks[variant] = running.enter_context(LocalStack(config, scheduler=scheduler_settings(),
                                                                   log_dir=log_dir))  # fmt: skip
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for variant, stack in stacks.items():
                time.sleep(1.0)  # let the last run's threads settle
                before = _cpu_seconds(stack.process("scheduler").pid)
                result = run_online_bench(stack.address, prompts, concurrency=args.concurrency,
                                          max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)  # fmt: skip
                used = _cpu_seconds(stack.process("scheduler").pid) - before
                tokens = sum(len(r.token_ids) for r in result.ok)
                print(f"round {round_} {variant or 'default'}: {result.output_throughput:.0f} tok/s", flush=True)
                if round_:
                    throughput.setdefault(variant, []).append(result.output_throughput)
                    scheduler_cpu.setdefault(variant, []).append(1000 * used / tokens)
    print(f"\n| {args.mode} placement | tok/s | vs default | scheduler CPU s / 1k tokens |\n|---|---|---|---|")
    base = statistics.median(throughput[args.variants[0]])
    for variant, values in throughput.items():
        tok_s = statistics.median(values)
        print(f"| {variant or 'default'} | {tok_s:.0f} | {tok_s / base:.2f} | "
              f"{statistics.median(scheduler_cpu[variant]):.3f} |")  # fmt: skip


@contextmanager
def _environment(variant: str) -> Iterator[None]:
    """NAME=VALUE pairs set for the processes started inside the block; the environment is restored after."""
    saved = dict(os.environ)
    os.environ.update(pair.split("=", 1) for pair in variant.split(",") if pair)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
