"""A drafter pool against a drafter per group, on this machine: the same streamed load through the gateway.

Topologies, each `--groups` engine groups behind a gateway, all resident at once and measured in turn
(interleaved rounds, the same prompts and settings):

- own:  each group its own drafter process (`up --engine-groups G --no-colocate-drafter`);
- pool: the groups share `--pool` pool drafters (`up --engine-groups G --drafter-pool N`): one process fewer per
  group, less one per pool drafter.

Reports output tokens per second (of the whole stack, and per process), per-request latency and acceptance.
Greedy: the outputs of the two must be equal (and are checked).

    python benchmarks/drafter_pool.py --model smollm2-135m-instruct --rounds 3 --concurrency 8 --json pool.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from minedraft.bench.online import BenchResult, run_online_bench
from minedraft.config import EngineConfig
from minedraft.frontends.chat import ChatTemplate
from minedraft.settings import WorkerSettings
from minedraft.stack.gateway import GatewayStack

ROOT = Path(__file__).resolve().parents[1]


def chat_prompts(config: EngineConfig, n: int) -> list[str]:
    """The held-out chat prompts, rendered with the target's chat template."""
    template = ChatTemplate.from_checkpoint(config.tokenizer_path)
    lines = (ROOT / "models" / "prompts" / "chat-heldout.jsonl").read_text().splitlines()[:n]
    questions = [json.loads(line)["prompt"] for line in lines]
    if template is None:
        return questions
    return [template.render([{"role": "user", "content": q}]) for q in questions]


def stacks(config: EngineConfig, groups: int, pool: int, log_dir: Path) -> dict[str, GatewayStack]:
    own = WorkerSettings(colocate_drafter=False)
    return {
        "own": GatewayStack(config, groups, worker=own, log_dir=log_dir / "own"),
        "pool": GatewayStack(config, groups, drafter_pool=pool, log_dir=log_dir / "pool"),
    }


def processes(stack: GatewayStack) -> int:
    return len(stack.processes())


def summary(name: str, runs: list[BenchResult], count: int) -> dict:
    tput = [r.output_throughput for r in runs]
    accepted = [r.mean_accepted_length for r in runs if r.mean_accepted_length]
    return {
        "topology": name, "processes": count, "rounds": len(runs),
        "tok_s": statistics.median(tput), "tok_s_min": min(tput), "tok_s_max": max(tput),
        "tok_s_per_process": statistics.median(tput) / count,
        "e2el_p50_s": statistics.median(r.e2el.median for r in runs),
        "ttft_p50_s": statistics.median(r.ttft.median for r in runs),
        "mean_accepted_length": statistics.median(accepted) if accepted else None,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = ["| topology | processes | output tok/s (median, min-max) | tok/s per process | e2e p50 s | "
             "TTFT p50 s | accepted length |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        accepted = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else "-"
        lines.append(f"| {r['topology']} | {r['processes']} | {r['tok_s']:.1f} ({r['tok_s_min']:.1f}-"
                     f"{r['tok_s_max']:.1f}) | {r['tok_s_per_process']:.1f} | {r['e2el_p50_s']:.2f} | "
                     f"{r['ttft_p50_s']:.2f} | {accepted} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target (default: the bundled pair)")
    parser.add_argument("--draft", default=None, help="draft model folder (default: the target's packaged draft)")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--pool", type=int, default=1, help="pool drafters")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="streams in flight over all groups")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    spec = {"num_speculative_tokens": args.num_speculative_tokens, "is_parallel": True,
            **({"model": args.draft} if args.draft else {})}  # fmt: skip
    config = EngineConfig(model=args.model, speculative_config=spec, device="cpu")
    prompts = chat_prompts(config, args.num_prompts)
    options = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "temperature": 0.0,
               "ignore_eos": True, "warmup": 2, "progress": False}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        topologies = stacks(config, args.groups, args.pool, Path(tmp))
        for stack in topologies.values():
            stack.start()
        try:
            runs: dict[str, list[BenchResult]] = {name: [] for name in topologies}
            for round_ in range(args.rounds):
                for name, stack in topologies.items():
                    result = run_online_bench(stack.address, prompts, **options)
                    runs[name].append(result)
                    print(f"round {round_ + 1} {name}: {result.output_throughput:.1f} tok/s", flush=True)
            outputs = {name: [r.token_ids for r in rs[-1].records] for name, rs in runs.items()}
            assert outputs["own"] == outputs["pool"], "greedy outputs differ between the topologies"
            rows = [summary(name, rs, processes(topologies[name])) for name, rs in runs.items()]
        finally:
            for stack in topologies.values():
                stack.stop()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
