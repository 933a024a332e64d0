"""Served against offline, with and without plans sent ahead: what the step protocol costs.

For each decoding mode this runs, interleaved round by round on the same prompts:

- `offline`: the engine in this process (`minedraft.LLM`), the yardstick;
- `served-1`: `minedraft up`'s services, each step planned after the last one's results (one step in flight);
- `served-2`: the same services, the next plan sent while a step runs (two in flight, the default).

It prints tok/s (median of the rounds), served / offline, and each worker's idle share of its time
(`minedraft:worker_idle_seconds` against `minedraft:worker_step_seconds`), and checks that every greedy
output equals the offline one. A second table says where the CPU went: CPU seconds per 1,000 output
tokens of each process (the client is this process; Linux, from /proc), the served overhead by its owner.

    python benchmarks/step_protocol.py                      # ar, sd, minedraft; 32 prompts x 64 tokens
    python benchmarks/step_protocol.py --modes sd --rounds 5 --num-prompts 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

from minedraft import LLM, SamplingParams
from minedraft.bench.cpu import process_cpu_seconds
from minedraft.bench.offline import mode_configs
from minedraft.bench.online import run_online_bench
from minedraft.bench.prompts import load_prompts
from minedraft.bench.rounds import interleaved
from minedraft.config import EngineConfig
from minedraft.stack.local import LocalStack, free_port, scheduler_settings


class Round(NamedTuple):
    """One timed run of one engine."""

    tok_s: float
    tokens: list[list[int]]
    idle: dict[str, float]  # each worker's idle share of its time (served)
    cpu: dict[str, float]  # CPU seconds per 1,000 output tokens, by process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="ar,sd,minedraft")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    modes = args.modes.split(",")
    prompts = load_prompts(limit=args.num_prompts)
    configs = mode_configs({"num_speculative_tokens": args.k})
    engine = {"device": "cpu", "max_num_seqs": args.concurrency}
    with ExitStack() as running, tempfile.TemporaryDirectory() as logs:
        engines = {}
        for mode in modes:
            config = EngineConfig(**engine, speculative_config=configs[mode])
            # MineDraft runs two batches of max_num_seqs: the same number in flight as the others.
            if mode in ("minedraft", "pearl"):
                config = config.model_copy(update={"max_num_seqs": max(1, args.concurrency // 2)})
            engines[(mode, "offline")] = LLM(**config.model_dump(exclude={"speculative_config"}),
                                             speculative_config=configs[mode])  # fmt: skip
            for depth in (1, 2):
                port = free_port()
                settings = scheduler_settings(metrics_port=port, max_steps_in_flight=depth)
                log_dir = Path(logs) / f"{mode}-{depth}"
                log_dir.mkdir()
                stack = LocalStack(config, scheduler=settings, log_dir=log_dir)
                engines[(mode, f"served-{depth}")] = (running.enter_context(stack), f"http://127.0.0.1:{port}/metrics")

        def runner(target) -> Callable[[int], Round]:
            def run(_round: int) -> Round:
                before = _cpu_seconds(target)
                tok_s, tokens, shares = _run(target, prompts, args)
                used = {name: seconds - before[name] for name, seconds in _cpu_seconds(target).items()}
                return Round(tok_s, tokens, shares, {n: 1000 * s / sum(map(len, tokens)) for n, s in used.items()})

            return run

        def report(round_: int, key: tuple[str, str], result: Round) -> None:
            if round_:  # round 0 warms up
                print(f"round {round_} {key[0]:>9} {key[1]:<9} {result.tok_s:8.1f} tok/s", flush=True)

        # Round 0 warms up; 1 s idle before each run lets the last run's threads settle.
        runs = {key: runner(target) for key, target in engines.items()}
        timed = interleaved(runs, args.rounds, warmup=1, settle_s=1.0, report=report)
    results = {key: [r.tok_s for r in rounds] for key, rounds in timed.items()}
    idle = {key: [r.idle for r in rounds] for key, rounds in timed.items()}
    cpu = {key: [r.cpu for r in rounds] for key, rounds in timed.items()}
    outputs = {key: rounds[-1].tokens for key, rounds in timed.items()}
    _report(modes, results, idle, outputs)
    _report_cpu(modes, cpu)


def _run(target, prompts: list[str], args) -> tuple[float, list[list[int]], dict[str, float]]:
    if isinstance(target, LLM):
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        out = target.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in out]
        return sum(map(len, tokens)) / seconds, tokens, {}
    stack, metrics_url = target
    result = run_online_bench(stack.address, prompts, concurrency=args.concurrency, max_tokens=args.max_tokens,
                              temperature=0.0, ignore_eos=True, metrics_url=metrics_url)  # fmt: skip
    tokens = [r.token_ids for r in sorted(result.ok, key=lambda r: r.index)]
    return result.output_throughput, tokens, result.server.worker_idle_share if result.server else {}


def _cpu_seconds(target) -> dict[str, float]:
    """CPU time (user + system, every thread) used so far by this process and each service process."""
    seconds = {"client": time.process_time()}
    if not isinstance(target, LLM):
        stack, _ = target
        for name in ("scheduler", "verifier", "drafter"):
            try:
                seconds[name] = process_cpu_seconds(stack.process(name).pid)
            except (KeyError, OSError):  # no such service in this mode
                continue
    return seconds


def _report_cpu(modes, cpu) -> None:
    names = ["client", "scheduler", "verifier", "drafter"]
    print("\nCPU seconds per 1,000 output tokens (median round; `client` is the engine itself offline)\n")
    print("| mode | engine | " + " | ".join(names) + " | total |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for (mode, variant), rounds in cpu.items():
        median = {n: statistics.median(r[n] for r in rounds) for n in names if n in rounds[0]}
        cells = [f"{median[n]:.2f}" if n in median else "-" for n in names]
        print(f"| {mode} | {variant} | " + " | ".join(cells) + f" | {sum(median.values()):.2f} |")


def _report(modes, results, idle, outputs) -> None:
    print("\n| mode | engine | tok/s | vs offline | verifier idle | drafter idle | outputs != offline |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        offline = statistics.median(results[(mode, "offline")])
        for variant in ("offline", "served-1", "served-2"):
            key = (mode, variant)
            tok_s = statistics.median(results[key])
            shares = {role: statistics.median(s.get(role, 0.0) for s in idle[key]) for role in ("verifier", "drafter")}
            differ = sum(a != b for a, b in zip(outputs[key], outputs[(mode, "offline")]))
            fmt = {r: f"{v:.1%}" if variant != "offline" and (v or r == "verifier") else "-" for r, v in shares.items()}
            print(f"| {mode} | {variant} | {tok_s:.0f} | {tok_s / offline:.2f} | {fmt['verifier']} | {fmt['drafter']} "
                  f"| {differ} |")


if __name__ == "__main__":
    main()
