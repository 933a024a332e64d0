"""Prefix caching on multi-turn chat: the same conversations with the cache on and off, offline and served.

    python benchmarks/prefix_cache.py                       # 16 conversations x 4 turns, offline and served
    python benchmarks/prefix_cache.py --where offline --rounds 1 --out /tmp/prefix

Every conversation opens with the same system prompt (--system-tokens of the bundled held-out prompts) and
adds a user turn (--user-tokens) per turn; each turn's prompt is the whole history so far: system prompt,
earlier user turns and the model's greedy answers (--max-tokens). The conversations run at once, each
sending its next turn when the previous answer is complete (a closed loop, as chat clients do). A second
load, single-turn requests that share no prefix, checks that the cache costs nothing where it cannot help.

Offline: one engine per setting in this process. Served: one `LocalStack` per setting (scheduler + workers
as local processes), driven through the gRPC client with streaming; TTFT is the client's wait for the first
token. Rounds alternate between the settings, medians are reported. The outputs of both settings must be
identical (greedy); the script exits 1 if they are not. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from minedraft.bench.offline import mode_configs
from minedraft.bench.prompts import load_prompts
from minedraft.config import BUNDLED_TARGET, EngineConfig
from minedraft.metrics import PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES, scrape
from minedraft.model.tokenizer import load_tokenizer

SETTINGS = {"cache on": True, "cache off": False}


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft: float
    output_ids: list[int]


@dataclass
class Run:
    """One round of one load under one setting."""

    seconds: float
    turns: list[Turn]
    hit_rate: float

    @property
    def output_tokens(self) -> int:
        return sum(len(t.output_ids) for t in self.turns)

    def ttfts(self, later: bool) -> list[float]:
        return [t.ttft for t in self.turns if (t.turn > 0) == later]


@dataclass
class Workload:
    """Token ids: the shared system prompt and each conversation's user turns."""

    system: list[int]
    users: list[list[list[int]]]  # [conversation][turn]
    max_tokens: int
    shared: bool = True  # False: each conversation has one turn and no prefix in common with the others

    def first_prompt(self, conversation: int) -> list[int]:
        return (self.system if self.shared else []) + self.users[conversation][0]


def build_workloads(args: argparse.Namespace, round_: int) -> dict[str, Workload]:
    """Round `round_`'s loads: the same system prompt every round, user turns and unshared prompts new in each
    (a round never finds the previous round's conversations in the cache)."""
    tokenizer = load_tokenizer(BUNDLED_TARGET)
    encoded = [tokenizer.encode(t) for t in load_prompts()]
    pool = [t for ids in encoded for t in ids]
    user = [ids[: args.user_tokens] for ids in encoded]
    n, first = args.conversations, lambda c: round_ * args.conversations + c
    later = lambda c, t: n * (args.rounds + 1) + first(c) * (args.turns - 1) + t - 1  # noqa: E731
    users = [[user[(first(c) if t == 0 else later(c, t)) % len(user)] for t in range(args.turns)] for c in range(n)]
    # No shared prefix: each request its own slice of the pool after the system prompt (starts 197 tokens apart,
    # 197 is prime), as long as a later chat turn's prompt.
    length, rest = args.system_tokens + args.user_tokens, len(pool) - args.system_tokens
    starts = [args.system_tokens + (round_ * 2 * n + c) * 197 % rest for c in range(2 * n)]
    unique = [[pool[(s + i) % len(pool)] for i in range(length)] for s in starts]
    return {
        "chat": Workload(pool[: args.system_tokens], users, args.max_tokens),
        "no shared prefix": Workload([], [[u] for u in unique], args.max_tokens, shared=False),
    }


Send = Callable[[list[int]], Awaitable[tuple[float, list[int]]]]  # prompt -> (ttft, output ids)


async def converse(workload: Workload, send: Send) -> list[Turn]:
    """Every conversation at once; each turn waits for the previous answer."""

    async def one(c: int) -> list[Turn]:
        prompt, turns = workload.first_prompt(c), []
        for t, user in enumerate(workload.users[c]):
            if t:
                prompt = prompt + user
            ttft, output = await send(prompt)
            turns.append(Turn(c, t, ttft, output))
            prompt = prompt + output
        return turns

    results = await asyncio.gather(*(one(c) for c in range(len(workload.users))))
    return [turn for turns in results for turn in turns]


# --- offline: the engine in this process, stepped by a small event loop ----------------------------------


class OfflineServer:
    """An LLMEngine stepped by an asyncio task, so the conversations' closed loops run as they would served."""

    def __init__(self, config: EngineConfig) -> None:
        from minedraft.engine.engine import LLMEngine

        self.engine = LLMEngine.local(config, max_in_flight=2)
        self._waiting: dict[str, asyncio.Future] = {}

    async def send(self, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        from minedraft.sampling.params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        request = self.engine.add_request(prompt, params)
        future = self._waiting[request.request_id] = asyncio.get_running_loop().create_future()
        await future
        return request.first_token_time - request.arrival_time, list(request.output_ids)

    async def drive(self, done: asyncio.Event) -> None:
        while not done.is_set():
            touched = self.engine.advance() if self.engine.has_unfinished() or self.engine.in_flight else None
            for request in touched or []:
                if request.finished:
                    self._waiting.pop(request.request_id).set_result(None)
            await asyncio.sleep(0)

    def hit_rate(self) -> float:
        return self.engine.step_stats.prefix_cache_hit_rate()

    def close(self) -> None:
        self.engine.executor.close()


async def run_offline(server: OfflineServer, workload: Workload) -> Run:
    server.engine.step_stats.prefix_cache_queries.clear()
    server.engine.step_stats.prefix_cache_hits.clear()
    done = asyncio.Event()
    driver = asyncio.create_task(server.drive(done))
    start = time.perf_counter()
    turns = await converse(workload, lambda p: server.send(p, workload.max_tokens))
    seconds = time.perf_counter() - start
    done.set()
    await driver
    return Run(seconds, turns, server.hit_rate())


# --- served: a local stack per setting, the gRPC client --------------------------------------------------


async def run_served(address: str, metrics_url: str, workload: Workload) -> Run:
    from minedraft.client import AsyncClient

    before = scrape(metrics_url)
    async with AsyncClient(address, timeout=600) as client:

        async def send(prompt: list[int]) -> tuple[float, list[int]]:
            start, first, output = time.perf_counter(), None, []
            async for delta in client.stream(prompt, max_tokens=workload.max_tokens, temperature=0, ignore_eos=True):
                if delta.token_ids and first is None:
                    first = time.perf_counter() - start
                output.extend(delta.token_ids)
            return first or 0.0, output

        start = time.perf_counter()
        turns = await converse(workload, send)
        seconds = time.perf_counter() - start
    after = scrape(metrics_url)
    queries = after.get(PREFIX_CACHE_QUERIES + "_total", 0) - before.get(PREFIX_CACHE_QUERIES + "_total", 0)
    hits = after.get(PREFIX_CACHE_HITS + "_total", 0) - before.get(PREFIX_CACHE_HITS + "_total", 0)
    return Run(seconds, turns, hits / queries if queries else 0.0)


# --- the comparison --------------------------------------------------------------------------------------


@dataclass
class Results:
    runs: dict[str, dict[str, dict[str, list[Run]]]] = field(default_factory=dict)  # where -> load -> setting

    def add(self, where: str, load: str, setting: str, run: Run) -> None:
        self.runs.setdefault(where, {}).setdefault(load, {}).setdefault(setting, []).append(run)


def median_run(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else 0.0


def table(results: Results) -> str:
    rows = ["| where | load | setting | tok/s | TTFT p50 turn 1 (ms) | TTFT p50 later turns (ms) | "
            "TTFT p99 later turns (ms) | hit rate |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for where, loads in results.runs.items():
        for load, settings in loads.items():
            for setting, runs in settings.items():
                run = median_run(runs)
                later = run.ttfts(True)
                p50_later = f"{statistics.median(later) * 1e3:.0f}" if later else "-"
                p99_later = f"{percentile(later, 99) * 1e3:.0f}" if later else "-"
                rows.append(f"| {where} | {load} | {setting} | {run.output_tokens / run.seconds:.0f} | "
                            f"{statistics.median(run.ttfts(False)) * 1e3:.0f} | {p50_later} | {p99_later} | "
                            f"{run.hit_rate:.2f} |")  # fmt: skip
    for where, loads in results.runs.items():
        chat = loads.get("chat", {})
        if {"cache on", "cache off"} <= set(chat):
            on, off = median_run(chat["cache on"]), median_run(chat["cache off"])
            ratio = statistics.median(off.ttfts(True)) / statistics.median(on.ttfts(True))
            rows.append(f"\n{where}: later turns' TTFT p50 is {ratio:.1f}x lower with the cache")
    return "\n".join(rows)


def identical(results: Results) -> bool:
    """Greedy outputs must not depend on the cache: each round's outputs equal across the settings."""
    for loads in results.runs.values():
        for settings in loads.values():
            for rounds in zip(*settings.values()):
                outputs = [{(t.conversation, t.turn): t.output_ids for t in run.turns} for run in rounds]
                if any(o != outputs[0] for o in outputs):
                    return False
    return True


def engine_config(args: argparse.Namespace, cache: bool) -> EngineConfig:
    spec = mode_configs({"num_speculative_tokens": args.k})[args.mode]
    return EngineConfig(speculative_config=spec, max_num_seqs=args.conversations, device="cpu",
                        enable_prefix_caching=cache)  # fmt: skip


def measure_offline(args: argparse.Namespace, results: Results) -> None:
    servers = {name: OfflineServer(engine_config(args, cache)) for name, cache in SETTINGS.items()}
    try:
        for server in servers.values():  # warm-up: unshared prompts of their own (nothing useful cached)
            asyncio.run(run_offline(server, build_workloads(args, args.rounds)["no shared prefix"]))
        for round_ in range(args.rounds):
            for load, workload in build_workloads(args, round_).items():
                for name, server in servers.items():
                    time.sleep(args.settle)
                    run = asyncio.run(run_offline(server, workload))
                    results.add("offline", load, name, run)
                    print(f"offline round {round_ + 1} {load} {name}: {run.output_tokens / run.seconds:.0f} tok/s, "
                          f"hit rate {run.hit_rate:.2f}", flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            server.close()


def measure_served(args: argparse.Namespace, results: Results, logs: Path) -> None:
    from minedraft.launcher import LocalStack, free_port, scheduler_settings

    with ExitStack() as running:
        stacks = {}
        for name, cache in SETTINGS.items():
            port = free_port()
            folder = logs / name.replace(" ", "-")
            folder.mkdir(parents=True, exist_ok=True)
            stack = LocalStack(engine_config(args, cache), scheduler=scheduler_settings(metrics_port=port),
                               log_dir=folder)  # fmt: skip
            stacks[name] = (running.enter_context(stack).address, f"http://127.0.0.1:{port}/metrics")
        for address, url in stacks.values():
            asyncio.run(run_served(address, url, build_workloads(args, args.rounds)["no shared prefix"]))
        for round_ in range(args.rounds):
            for load, workload in build_workloads(args, round_).items():
                for name, (address, url) in stacks.items():
                    time.sleep(args.settle)
                    run = asyncio.run(run_served(address, url, workload))
                    results.add("served", load, name, run)
                    print(f"served round {round_ + 1} {load} {name}: {run.output_tokens / run.seconds:.0f} tok/s, "
                          f"hit rate {run.hit_rate:.2f}", flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--where", choices=["offline", "served", "both"], default="both")
    parser.add_argument("--mode", default="minedraft", choices=list(mode_configs({})))
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (the most, with adaptive k)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48, help="answer length per turn (greedy, EOS ignored)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds idle before each timed run (the last engine's OpenMP threads spin a while)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "minedraft-prefix-cache")
    args = parser.parse_args()
    results = Results()
    if args.where in ("offline", "both"):
        measure_offline(args, results)
    if args.where in ("served", "both"):
        measure_served(args, results, args.out.parent / (args.out.name + "-logs"))
    same = identical(results)
    report = table(results) + f"\n\noutputs identical with and without the cache: {same}"
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(report + "\n")
    raw = {where: {load: {s: [{"seconds": r.seconds, "output_tokens": r.output_tokens, "hit_rate": r.hit_rate,
                              "ttft": [t.ttft for t in r.turns], "turn": [t.turn for t in r.turns]} for r in runs]
                          for s, runs in settings.items()} for load, settings in loads_.items()}
           for where, loads_ in results.runs.items()}  # fmt: skip
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
