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
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from minedraft.bench.cpu import process_cpu_seconds
from minedraft.bench.offline import mode_configs
from minedraft.bench.online import run_online_bench
from minedraft.bench.prompts import load_prompts
from minedraft.bench.rounds import interleaved
from minedraft.config import EngineConfig
from minedraft.stack.local import LocalStack, scheduler_settings


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
    with ExitStack() as running, tempfile.TemporaryDirectory() as logs:
        stacks = {}
        for index, variant in enumerate(args.variants):
            log_dir = Path(logs) / str(index)
            log_dir.mkdir()
            with _environment(variant):
                stacks[variant] = running.enter_context(LocalStack(config, scheduler=scheduler_settings(),
                                                                   log_dir=log_dir))  # fmt: skip

        def runner(stack: LocalStack) -> Callable[[int], tuple[float, float]]:
            def run(_round: int) -> tuple[float, float]:
                """tok/s, and the scheduler's CPU seconds per 1,000 output tokens."""
                scheduler = stack.process("scheduler").pid
                before = process_cpu_seconds(scheduler)
                result = run_online_bench(stack.address, prompts, concurrency=args.concurrency,
                                          max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)  # fmt: skip
                used = process_cpu_seconds(scheduler) - before
                tokens = sum(len(r.token_ids) for r in result.ok)
                return result.output_throughput, 1000 * used / max(1, tokens)

            return run

        def report(round_: int, variant: str, result: tuple[float, float]) -> None:
            print(f"round {round_} {variant or 'default'}: {result[0]:.0f} tok/s", flush=True)

        # Round 0 warms up; 1 s idle before each run lets the last run's threads settle.
        runs = {variant: runner(stack) for variant, stack in stacks.items()}
        timed = interleaved(runs, args.rounds, warmup=1, settle_s=1.0, report=report)
    print(f"\n| {args.mode} placement | tok/s | vs default | scheduler CPU s / 1k tokens |\n|---|---|---|---|")
    base = statistics.median(tok_s for tok_s, _ in timed[args.variants[0]])
    for variant, rounds in timed.items():
        tok_s = statistics.median(t for t, _ in rounds)
        print(f"| {variant or 'default'} | {tok_s:.0f} | {tok_s / base:.2f} | "
              f"{statistics.median(cpu for _, cpu in rounds):.3f} |")  # fmt: skip


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


if __name__ == "__main__":
    main()
