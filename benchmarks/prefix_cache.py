"""Prefix caching on multi-turn chat: the same conversations with the cache on and off, offline and served,
ours and (with --vllm) vLLM's.

    python benchmarks/prefix_cache.py                        # ours: offline and served, 3 rounds
    python benchmarks/prefix_cache.py --vllm                 # and `vllm serve` with its cache on and off
    python benchmarks/prefix_cache.py --where offline --rounds 1 --out /tmp/prefix
    python benchmarks/prefix_cache.py --where offline --loads chat --kv-cache-memory-bytes 29491200

Every conversation opens with the same system prompt (--system-tokens of the bundled held-out prompts) and
adds a user turn (--user-tokens, a held-out prompt's start) per turn; each turn's prompt is the whole
history as text: system prompt, earlier user turns and the model's greedy answers (--max-tokens, EOS
ignored). The conversations run at once, each sending its next turn when the previous answer is complete
(a closed loop, as chat clients do). A second load, single-turn prompts that share nothing, checks that the
cache costs nothing where it cannot help. Each round brings new user turns and new unshared prompts (the
system prompt stays), so no round finds the previous one's conversations in a cache.

Offline: one engine per setting in this process. Served: one server per setting, `minedraft up --http-port`
(and `vllm serve` with the draft model, k the same), all driven through the same streaming client of the
OpenAI completions API; TTFT is the client's wait for the first text. Hit rates come from each server's
`vllm:prefix_cache_*` counters (ours exports them under vLLM's names too). Rounds alternate between the
settings, medians are reported. The answers with the cache on must equal those with it off (greedy); the
script exits 1 if they do not. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from minedraft.bench.conversations import HttpServer, Run, Workload, converse, percentile
from minedraft.bench.offline import mode_configs
from minedraft.bench.prompts import load_prompts
from minedraft.bench.rounds import interleaved, median_by
from minedraft.bench.servers import start_server, wait_healthy
from minedraft.bench.vllm_env import VENV, ensure_venv
from minedraft.config import BUNDLED_TARGET, EngineConfig
from minedraft.model.tokenizer import load_tokenizer

SETTINGS = {"cache on": True, "cache off": False}


def build_workloads(args: argparse.Namespace, round_: int) -> dict[str, Workload]:
    """Round `round_`'s loads: the same system prompt every round, user turns and unshared prompts new in each."""
    tokenizer = load_tokenizer(BUNDLED_TARGET)
    encoded = [tokenizer.encode(t) for t in load_prompts()]
    pool = [t for ids in encoded for t in ids]
    user = [tokenizer.decode(ids[: args.user_tokens]) for ids in encoded]
    n, first = args.conversations, lambda c: round_ * args.conversations + c
    later = lambda c, t: n * (args.rounds + 1) + first(c) * (args.turns - 1) + t - 1  # noqa: E731
    users = [[user[(first(c) if t == 0 else later(c, t)) % len(user)] for t in range(args.turns)] for c in range(n)]
    # No shared prefix: each request its own slice of the pool after the system prompt (starts 197 tokens apart,
    # 197 is prime), as long as a later chat turn's prompt.
    length, rest = args.system_tokens + args.user_tokens, len(pool) - args.system_tokens
    starts = [args.system_tokens + (round_ * 2 * n + c) * 197 % rest for c in range(2 * n)]
    unique = [tokenizer.decode([pool[(s + i) % len(pool)] for i in range(length)]) for s in starts]
    return {
        "chat": Workload(tokenizer.decode(pool[: args.system_tokens]), users),
        "no shared prefix": Workload("", [[u] for u in unique]),
    }


# --- offline: the engine in this process, stepped by a small event loop ----------------------------------


class OfflineServer:
    """An LLMEngine stepped by an asyncio task, so the conversations' closed loops run as they would served."""

    def __init__(self, config: EngineConfig, max_tokens: int) -> None:
        from minedraft.engine.engine import LLMEngine
        from minedraft.sampling.params import SamplingParams

        self.engine = LLMEngine.local(config, max_in_flight=2)
        self.tokenizer = load_tokenizer(config.target_path)
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self._waiting: dict[str, asyncio.Future] = {}

    async def send(self, prompt: str) -> tuple[float, str, int]:
        request = self.engine.add_request(self.tokenizer.encode(prompt), self.params)
        future = self._waiting[request.request_id] = asyncio.get_running_loop().create_future()
        await future
        return request.first_token_time - request.arrival_time, request.text, len(request.output_ids)

    async def drive(self, done: asyncio.Event) -> None:
        while not done.is_set():
            touched = self.engine.advance() if self.engine.has_unfinished() or self.engine.in_flight else None
            for request in touched or []:
                if request.finished:
                    self._waiting.pop(request.request_id).set_result(None)
            await asyncio.sleep(0)

    async def run(self, workload: Workload) -> Run:
        stats = self.engine.step_stats
        stats.prefix_cache_queries.clear(), stats.prefix_cache_hits.clear()
        done = asyncio.Event()
        driver = asyncio.create_task(self.drive(done))
        start = time.perf_counter()
        turns, tokens = await converse(workload, self.send)
        seconds = time.perf_counter() - start
        done.set()
        await driver
        return Run(seconds, turns, tokens, stats.prefix_cache_hit_rate())

    def close(self) -> None:
        self.engine.executor.close()


# --- the comparison --------------------------------------------------------------------------------------


@dataclass
class Results:
    runs: dict[str, dict[str, list[Run]]] = field(default_factory=dict)  # "where, setting" -> load -> rounds

    def add(self, name: str, load: str, run: Run) -> None:
        self.runs.setdefault(name, {}).setdefault(load, []).append(run)


def median_run(runs: list[Run]) -> Run:
    return median_by(runs, lambda r: r.seconds)


def table(results: Results) -> str:
    rows = ["| server, setting | load | tok/s | TTFT p50 turn 1 (ms) | TTFT p50 later turns (ms) | "
            "TTFT p99 later turns (ms) | hit rate |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, loads in results.runs.items():
        for load, runs in loads.items():
            run = median_run(runs)
            later = run.ttfts(True)
            p50_later = f"{statistics.median(later) * 1e3:.0f}" if later else "-"
            p99_later = f"{percentile(later, 99) * 1e3:.0f}" if later else "-"
            rows.append(f"| {name} | {load} | {run.output_tokens / run.seconds:.0f} | "
                        f"{statistics.median(run.ttfts(False)) * 1e3:.0f} | {p50_later} | {p99_later} | "
                        f"{run.hit_rate:.2f} |")  # fmt: skip
    rows.append("")
    for where in dict.fromkeys(name.rsplit(", ", 1)[0] for name in results.runs):
        on, off = results.runs.get(f"{where}, cache on"), results.runs.get(f"{where}, cache off")
        if not on or not off:
            continue
        parts = []
        if "chat" in on and "chat" in off:
            ttft = [statistics.median(median_run(r["chat"]).ttfts(True)) for r in (off, on)]
            parts.append(f"later turns' TTFT p50 {ttft[0] / ttft[1]:.1f}x lower with the cache")
        if "no shared prefix" in on and "no shared prefix" in off:
            tok_s = [(lambda m: m.output_tokens / m.seconds)(median_run(r["no shared prefix"])) for r in (on, off)]
            parts.append(f"no shared prefix: tok/s on / off {tok_s[0] / tok_s[1]:.2f}")
        rows.append(f"{where}: " + "; ".join(parts))
    return "\n".join(rows)


def identical(results: Results) -> bool:
    """Greedy answers must not depend on the cache: each round's answers equal across a server's settings."""
    for where in dict.fromkeys(name.rsplit(", ", 1)[0] for name in results.runs):
        settings = [results.runs[f"{where}, {s}"] for s in SETTINGS if f"{where}, {s}" in results.runs]
        for load in settings[0]:
            for rounds in zip(*(s[load] for s in settings)):
                answers = [{(t.conversation, t.turn): t.answer for t in run.turns} for run in rounds]
                if any(a != answers[0] for a in answers):
                    return False
    return True


def engine_config(args: argparse.Namespace, cache: bool) -> EngineConfig:
    spec = mode_configs({"num_speculative_tokens": args.k})[args.mode]
    batches = 2 if spec and spec.get("is_parallel") and not spec.get("force_pearl") else 1
    return EngineConfig(speculative_config=spec, max_num_seqs=args.conversations // batches, device="cpu",
                        enable_prefix_caching=cache, kv_cache_memory_bytes=args.kv_cache_memory_bytes)  # fmt: skip


def measure(servers: dict[str, OfflineServer | HttpServer], args: argparse.Namespace, results: Results) -> None:
    """A warm-up on unshared prompts of their own, then the rounds, the servers taking turns."""
    for server in servers.values():
        asyncio.run(server.run(build_workloads(args, args.rounds)["no shared prefix"]))
    workloads = [build_workloads(args, round_) for round_ in range(args.rounds)]
    loads = [load for load in workloads[0] if load in args.loads]

    def runner(name: str, load: str):
        return lambda round_: asyncio.run(servers[name].run(workloads[round_][load]))

    def report(round_: int, key: tuple[str, str], run: Run) -> None:
        results.add(*key, run)
        print(f"round {round_ + 1} {key[1]} {key[0]}: {run.output_tokens / run.seconds:.0f} tok/s, hit rate "
              f"{run.hit_rate:.2f}", flush=True)  # fmt: skip

    # Alternating order (A B, then B A): a run's place after another setting or load counts too.
    runners = {(name, load): runner(name, load) for load in loads for name in servers}
    interleaved(runners, args.rounds, settle_s=args.settle, report=report)


def served(args: argparse.Namespace, running: ExitStack, logs: Path) -> dict[str, HttpServer]:
    """Ours (`--mode`) and, with --vllm, vLLM's sd with the same draft and k; each with the cache on and off."""
    logs.mkdir(parents=True, exist_ok=True)
    kinds = {f"ours {args.mode}": args.mode} | ({"vLLM sd": "vllm-sd"} if args.vllm else {})
    vllm_python = str(ensure_venv(args.venv)) if args.vllm else ""
    servers = {}
    for label, name in kinds.items():
        for setting, cache in SETTINGS.items():
            server = start_server(name, k=args.k, max_num_seqs=args.conversations, vllm_python=vllm_python, logs=logs,
                                  prefix_caching=cache, label=f"{name}-{setting.replace(' ', '-')}")  # fmt: skip
            running.callback(server.stop)
            wait_healthy(server, 600, logs)
            servers[f"served {label}, {setting}"] = HttpServer(server.url, args.max_tokens)
    return servers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--where", choices=["offline", "served", "both"], default="both")
    parser.add_argument("--vllm", action="store_true", help="serve vLLM's CPU build too (its venv: vs_vllm.py)")
    parser.add_argument("--venv", type=Path, default=VENV)
    parser.add_argument("--mode", default="minedraft",
                        choices=["ar", "sd", "pearl", "minedraft", "sd+eagle3", "minedraft+eagle3"])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (the most, with adaptive k)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48, help="answer length per turn (greedy, EOS ignored)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="each offline engine's KV budget per worker (default: the CPU default, 4 GiB); a tight "
                             "one shows admission counting shared blocks once")
    parser.add_argument("--loads", type=lambda v: v.split(","), default=["chat", "no shared prefix"],
                        help="comma-separated, of: chat, no shared prefix")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds idle before each timed run (the last engine's OpenMP threads spin a while)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "minedraft-prefix-cache")
    args = parser.parse_args()
    results = Results()
    if args.where in ("offline", "both"):
        offline = {f"offline {args.mode}, {s}": OfflineServer(engine_config(args, cache), args.max_tokens)
                   for s, cache in SETTINGS.items()}  # fmt: skip
        try:
            measure(offline, args, results)
        finally:
            for server in offline.values():
                server.close()
    if args.where in ("served", "both"):
        with ExitStack() as running:
            measure(served(args, running, args.out.parent / (args.out.name + "-logs")), args, results)
    same = identical(results)
    report = table(results) + f"\n\nanswers identical with and without the cache: {same}"
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(report + "\n")
    raw = {name: {load: [{"seconds": r.seconds, "output_tokens": r.output_tokens, "hit_rate": r.hit_rate,
                          "ttft": [t.ttft for t in r.turns], "turn": [t.turn for t in r.turns]} for r in runs]
                  for load, runs in loads.items()} for name, loads in results.runs.items()}  # fmt: skip
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
