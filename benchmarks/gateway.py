"""The gateway: one engine group against two, and what a group's death costs.

1. Throughput and latency, the same streamed load (`minedraft bench --target`'s) against one group
   directly, one group behind the gateway, and two groups behind the gateway.
2. Failover: two groups behind the gateway, concurrent greedy streams, one whole group (scheduler,
   verifier, drafter) SIGKILLed mid-stream. Reports requests lost (must be 0), outputs that differ from
   the undisturbed run (must be 0), and per interrupted stream the time from the kill to its next token
   (the migration: detecting the failure, resubmitting, re-prefill and queueing on the other group).

    python benchmarks/gateway.py                      # bundled pair, MineDraft, strict kernels
    python benchmarks/gateway.py --num-prompts 64 --concurrency 32 --skip-throughput
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from minedraft.bench.launch import format_comparison
from minedraft.bench.online import BenchResult, run_online_bench
from minedraft.bench.prompts import load_prompts
from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.stack.gateway import GatewayStack
from minedraft.stack.local import LocalStack


def throughput(config: EngineConfig, prompts: list[str], args: argparse.Namespace, log_dir: Path) -> str:
    runs: dict[str, BenchResult] = {}
    options = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "temperature": 0.0,
               "ignore_eos": True, "warmup": 2}  # fmt: skip
    with LocalStack(config, log_dir=log_dir) as stack:
        runs["1 group, direct"] = run_online_bench(stack.address, prompts, **options)
    for groups in (1, 2):
        with GatewayStack(config, groups, log_dir=log_dir / f"gw{groups}") as stack:
            runs[f"{groups} group{'s' if groups > 1 else ''}, gateway"] = run_online_bench(
                stack.address, prompts, **options
            )
    return format_comparison(runs)


class Streams:
    """Greedy streams in threads, each token's arrival time kept."""

    def __init__(self, address: str, prompts: list[str], max_tokens: int, concurrency: int) -> None:
        self.arrivals: list[list[float]] = [[] for _ in prompts]
        self._client = Client(address, timeout=600, retries=0)
        self._max_tokens = max_tokens
        self._pool = ThreadPoolExecutor(concurrency)
        self._futures = [self._pool.submit(self._one, i, p) for i, p in enumerate(prompts)]

    def _one(self, index: int, prompt: str) -> list[int]:
        ids: list[int] = []
        stream = self._client.stream(prompt, max_tokens=self._max_tokens, temperature=0, ignore_eos=True,
                                     request_id=f"r{index}")  # fmt: skip
        for delta in stream:
            ids += delta.token_ids
            self.arrivals[index].extend([time.monotonic()] * len(delta.token_ids))
        return ids

    @property
    def tokens(self) -> int:
        return sum(len(a) for a in self.arrivals)

    def results(self) -> list[list[int] | Exception]:
        out = []
        for future in self._futures:
            try:
                out.append(future.result())
            except Exception as exc:  # a lost request: counted, not raised
                out.append(exc)
        self._pool.shutdown()
        self._client.close()
        return out


def failover(config: EngineConfig, prompts: list[str], args: argparse.Namespace, log_dir: Path) -> str:
    with GatewayStack(config, 2, log_dir=log_dir / "failover") as stack:
        calm = Streams(stack.address, prompts, args.max_tokens, args.concurrency).results()
        streams = Streams(stack.address, prompts, args.max_tokens, args.concurrency)
        while streams.tokens < args.kill_after_tokens:
            time.sleep(0.005)
        killed_at = time.monotonic()
        stack.kill_group(0)
        wild = streams.results()
        duration = max(t for a in streams.arrivals for t in a[-1:]) - killed_at
    lost = sum(isinstance(r, Exception) for r in wild)
    changed = sum(1 for a, b in zip(calm, wild, strict=True) if not isinstance(b, Exception) and a != b)
    log = (log_dir / "failover" / "gateway.log").read_text()
    migrated = {int(i) for i in re.findall(r"request r(\d+): group .* resubmitting", log)}
    # streams mid-flight at the kill: the wait from the kill to their next token, migrated or not
    waits = {i: next(t for t in a if t > killed_at) - killed_at for i, a in enumerate(streams.arrivals)
             if a and a[0] < killed_at < a[-1]}  # fmt: skip
    moved = [w for i, w in waits.items() if i in migrated]
    stayed = [w for i, w in waits.items() if i not in migrated]
    return "\n".join([
        f"requests: {len(prompts)}, lost: {lost}, outputs changed: {changed}, migrated: {len(migrated)}",
        f"kill -> next token of a migrated stream: median {_median(moved)}, max {_max(moved)} "
        f"({len(moved)} streams)",
        f"kill -> next token of a stream on the surviving group: median {_median(stayed)}, max {_max(stayed)} "
        f"({len(stayed)} streams)",
        f"kill -> last token of the run: {duration:.1f}s",
    ])  # fmt: skip


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}s" if values else "-"


def _max(values: list[float]) -> str:
    return f"{max(values):.3f}s" if values else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--kill-after-tokens", type=int, default=1500, help="tokens streamed before the kill")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-failover", action="store_true")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args()
    config = EngineConfig(speculative_config={"num_speculative_tokens": 4, "is_parallel": True}, max_num_seqs=16,
                          batch_invariant=True)  # fmt: skip
    prompts = load_prompts(None, limit=args.num_prompts)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="minedraft-gateway-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if not args.skip_throughput:
        print(throughput(config, prompts, args, log_dir), flush=True)
    if not args.skip_failover:
        print(failover(config, prompts, args, log_dir), flush=True)
    print(f"service logs: {log_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
