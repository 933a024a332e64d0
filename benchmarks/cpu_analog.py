"""The paper's comparison on a CPU: one extra core for the drafter, as MineDraft gives it one extra GPU.

MineDraft's claim is "+75% over standard SD with one more GPU for the drafter". The CPU analog, served
(`minedraft up`'s processes, the client SDK), interleaved round by round on the same prompts:

- `sd, 1 core`: the verifier and the drafter pinned to core 0, one intra-op thread each;
- `minedraft, 1+1 cores`: the verifier pinned to core 0, the drafter to core 1, one thread each.

The scheduler and the benchmark client stay on the last core in both (they orchestrate, as the CPU does
beside the GPUs). Every thread of a worker process is pinned (Linux affinity, `/proc/<pid>/task`). It
prints tok/s, the ratio, the overlap efficiency (max(draft, verify) / step) and the workers' idle shares.

    python benchmarks/cpu_analog.py                   # 32 prompts x 64 tokens, k=4, 3 rounds
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from minedraft.bench.offline import mode_configs
from minedraft.bench.online import run_online_bench
from minedraft.bench.prompts import load_prompts
from minedraft.bench.records import BenchResult
from minedraft.bench.rounds import interleaved, median_by
from minedraft.config import EngineConfig
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

SETUPS = {  # mode -> (verifier core, drafter core)
    "sd": (0, 0),
    "minedraft": (0, 1),
}


def pin(pid: int, core: int) -> None:
    """Pin every thread of `pid` to `core` (threads started later inherit it from their creator)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {core})
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores")
    control = cores[-1]
    os.sched_setaffinity(0, {control})  # the client (and, inherited, the scheduler) on the last core
    os.environ["OMP_NUM_THREADS"] = "1"  # one intra-op thread per worker process
    prompts = load_prompts(limit=args.num_prompts)
    configs = mode_configs({"num_speculative_tokens": args.k})
    with ExitStack() as running, tempfile.TemporaryDirectory() as logs:
        stacks = {}
        for mode, (verifier_core, drafter_core) in SETUPS.items():
            seqs = args.concurrency // 2 if mode == "minedraft" else args.concurrency  # as many in flight
            config = EngineConfig(device="cpu", max_num_seqs=seqs, speculative_config=configs[mode])
            port = free_port()
            (Path(logs) / mode).mkdir()
            stack = running.enter_context(
                LocalStack(config, scheduler=scheduler_settings(metrics_port=port), log_dir=Path(logs) / mode)
            )
            pin(stack.process("verifier").pid, cores[verifier_core])
            pin(stack.process("drafter").pid, cores[drafter_core])
            stacks[mode] = (stack, f"http://127.0.0.1:{port}/metrics")

        def runner(stack: LocalStack, url: str) -> Callable[[int], BenchResult]:
            return lambda _round: run_online_bench(stack.address, prompts, concurrency=args.concurrency,
                                                   max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                                                   metrics_url=url)  # fmt: skip

        def report(round_: int, mode: str, result: BenchResult) -> None:
            print(f"round {round_} {mode:>9}: {result.output_throughput:.1f} tok/s", flush=True)

        # Round 0 warms up; 1 s idle before each run lets the last run's threads settle.
        runs = {mode: runner(*target) for mode, target in stacks.items()}
        results = interleaved(runs, args.rounds, warmup=1, settle_s=1.0, report=report)
    _report(results)


def _report(results: dict[str, list[BenchResult]]) -> None:
    medians = {mode: median_by(rs, lambda r: r.output_throughput) for mode, rs in results.items()}
    base = medians["sd"].output_throughput
    print("\n| setup | tok/s | vs sd on 1 core | overlap efficiency | verifier idle | drafter idle |")
    print("|---|---|---|---|---|---|")
    for mode, label in (("sd", "sd, 1 core"), ("minedraft", "minedraft, 1+1 cores")):
        r, s = medians[mode], medians[mode].server
        overlap = f"{s.overlap_efficiency:.2f}" if s and s.overlap_efficiency is not None else "-"
        idle = s.worker_idle_share if s else {}
        print(f"| {label} | {r.output_throughput:.0f} | {r.output_throughput / base:.2f} | {overlap} | "
              f"{idle.get('verifier', 0):.1%} | {idle.get('drafter', 0):.1%} |")
    spread = {m: [round(r.output_throughput) for r in rs] for m, rs in results.items()}
    print(f"\nrounds: {spread}; median sd {statistics.median(spread['sd'])}")


if __name__ == "__main__":
    main()
