"""Routing at the gateway: the goals of per-request speculation and cache-, load- and speed-aware routing.

1. Multi-turn chat whose own history dominates (--conversations x --turns, no shared system prompt: each
   conversation opens with its own --first-tokens of text, adds --user-tokens per later turn and keeps
   the greedy answers) over two engine groups (`minedraft up --engine-groups 2`), one gateway per policy
   (least-work, prefix, predicted) and, for reference, a gateway over one group alone. Each run brings
   conversations no run sent before (the groups' caches are shared by every gateway). Reported: the
   groups' prefix-cache hit rate over the run, TTFT p50 of the first and of the later turns, output tok/s.
2. A mixed load: half the requests `num_speculative_tokens: 0`, half the server's k, at once, through a
   gateway with --per-request-spec-decode-metrics summary: each request's own drafted tokens (0 for the
   first half), and every output against plain autoregressive decoding of the target in this process.
3. Two groups of different real speed, the same target: one drafts k tokens with the bundled draft, the
   other k tokens with a draft of random weights (useless, every window rejected); `predicted` against
   `least-work`, the same single-turn streamed load (`minedraft bench`'s OpenAI backend).

Every group runs MineDraft with fixed k (`adaptive: false`, so that drafts happen on the small pair) and
the strict kernels (greedy output equals ar token for token). Settings alternate within each round (A B,
then B A) and each setting's median round is reported.

    python benchmarks/gateway_routing.py                         # a few minutes on 2 cores
    python benchmarks/gateway_routing.py --rounds 3 --conversations 16 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

from minedraft.bench.conversations import HttpServer, Run, Workload
from minedraft.bench.online import BenchResult, run_online_bench
from minedraft.bench.prompts import load_prompts
from minedraft.bench.rounds import interleaved, median_by
from minedraft.config import BUNDLED_DRAFT, BUNDLED_TARGET, EngineConfig
from minedraft.metrics import scrape
from minedraft.model.tokenizer import load_tokenizer
from minedraft.settings import GatewaySettings
from minedraft.stack.gateway import GatewayStack
from minedraft.stack.local import child_env, free_port

POLICIES = ("least-work", "prefix", "predicted")


def engine_config(args: argparse.Namespace, draft: str | Path, max_num_seqs: int) -> EngineConfig:
    spec = {"model": str(draft), "num_speculative_tokens": args.k, "is_parallel": True, "adaptive": False}
    return EngineConfig(speculative_config=spec, max_num_seqs=max_num_seqs, device="cpu", batch_invariant=True)


def metrics_url(stack: GatewayStack, group: int) -> str:
    return f"http://127.0.0.1:{stack.groups[group].metrics_port}/metrics"


def start_gateway(stack: GatewayStack, running: ExitStack, policy: str, log: Path,
                  groups: Sequence[int] | None = None, spec_metrics: str | None = None) -> str:  # fmt: skip
    """Another gateway process over the stack's groups (or the `groups` named), routing by `policy`; its URL."""
    port = free_port()
    settings = stack.settings.model_copy(update={"http_port": port, "routing_policy": policy,
                                                 "per_request_spec_decode_metrics": spec_metrics})  # fmt: skip
    out = running.enter_context(open(log, "a"))  # noqa: SIM115
    process = subprocess.Popen(stack.gateway_command(port=free_port(), settings=settings, groups=groups),
                               env=stack.gateway_env(child_env(dict(os.environ))), stdout=out,
                               stderr=subprocess.STDOUT)  # fmt: skip
    running.callback(_stop, process)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                return url
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {policy} gateway did not start: see {log}") from None
            time.sleep(0.3)


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# --- 1. multi-turn chat -------------------------------------------------------------------------------------


class Texts:
    """Slices of the bundled prompts' tokens as text: slice i starts 197 tokens (a prime) after slice i - 1,
    so two slices share no prefix."""

    def __init__(self) -> None:
        self.tokenizer = load_tokenizer(BUNDLED_TARGET)
        self.pool = [t for text in load_prompts() for t in self.tokenizer.encode(text)]

    def slice(self, index: int, length: int) -> str:
        start = index * 197 % len(self.pool)
        return self.tokenizer.decode([self.pool[(start + i) % len(self.pool)] for i in range(length)])


def conversations(args: argparse.Namespace, texts: Texts, run: int) -> Workload:
    """Run `run`'s conversations: each opens with its own long text; later turns add short ones."""
    per_run = args.conversations * args.turns
    users = [[texts.slice(run * per_run + c * args.turns + t, args.first_tokens if t == 0 else args.user_tokens)
              for t in range(args.turns)] for c in range(args.conversations)]  # fmt: skip
    return Workload("", users)


def multi_turn(args: argparse.Namespace, log_dir: Path) -> tuple[str, dict[str, Run]]:
    config = engine_config(args, BUNDLED_DRAFT, max(1, args.conversations // 2))
    texts = Texts()
    with ExitStack() as running:
        stack = running.enter_context(GatewayStack(config, 2, metrics_ports=[free_port(), free_port()],
                                                   gateway=GatewaySettings(http_port=free_port()),
                                                   log_dir=log_dir / "multi-turn"))  # fmt: skip
        both = [metrics_url(stack, 0), metrics_url(stack, 1)]
        servers = {"1 group": HttpServer(start_gateway(stack, running, "least-work", log_dir / "gw-1.log", [0]),
                                         args.max_tokens, [both[0]])}  # fmt: skip
        for policy in POLICIES:
            url = start_gateway(stack, running, policy, log_dir / f"gw-{policy}.log")
            servers[f"2 groups, {policy}"] = HttpServer(url, args.max_tokens, both)
        names = list(servers)
        for i, server in enumerate(servers.values()):  # warm-up: conversations of its own
            asyncio.run(server.run(conversations(args, texts, (args.rounds + 1) * len(names) + i)))

        def runner(i: int, name: str) -> Callable[[int], Run]:  # every run its own conversations
            return lambda round_: asyncio.run(servers[name].run(conversations(args, texts, round_ * len(names) + i)))

        rounds = interleaved({name: runner(i, name) for i, name in enumerate(names)}, args.rounds,
                             settle_s=args.settle, report=_report_run)  # fmt: skip
    runs = {name: median_by(results, lambda r: r.seconds) for name, results in rounds.items()}
    return multi_turn_table(runs), runs


def _report_run(round_: int, name: str, run: Run) -> None:
    print(f"   round {round_ + 1} {name}: {run.tokens_per_second:.0f} tok/s, hit rate {run.hit_rate:.2f}, later-turn "
          f"TTFT p50 {_ms(run.later_ttft_p50())}", flush=True)  # fmt: skip


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def multi_turn_table(runs: dict[str, Run]) -> str:
    rows = ["| setting | output tok/s | TTFT p50 turn 1 (ms) | TTFT p50 later turns (ms) | prefix-cache hit rate |",
            "|---|---|---|---|---|"]  # fmt: skip
    for name, run in runs.items():
        rows.append(f"| {name} | {run.tokens_per_second:.0f} | {_ms(statistics.median(run.ttfts(False)))} | "
                    f"{_ms(run.later_ttft_p50())} | {run.hit_rate:.2f} |")  # fmt: skip
    one, least, prefix = runs["1 group"], runs["2 groups, least-work"], runs["2 groups, prefix"]
    predicted = runs["2 groups, predicted"]
    ttft = prefix.later_ttft_p50() / least.later_ttft_p50() if least.later_ttft_p50() else float("nan")
    rows += ["", "goals (prefix against least-work over 2 groups):",
             f"- hit rate within 0.05 of one group's: {prefix.hit_rate:.2f} vs {one.hit_rate:.2f} "
             f"({'met' if prefix.hit_rate >= one.hit_rate - 0.05 else 'NOT met'})",
             f"- later-turn TTFT p50 <= 0.7x least-work's: {ttft:.2f}x ({'met' if ttft <= 0.7 else 'NOT met'})",
             f"- no lower throughput: {prefix.tokens_per_second / least.tokens_per_second:.2f}x of least-work's "
             f"({'met' if prefix.tokens_per_second >= least.tokens_per_second else 'NOT met'})",
             f"- predicted on equal groups: {predicted.tokens_per_second / least.tokens_per_second:.2f}x "
             f"least-work's tok/s"]  # fmt: skip
    return "\n".join(rows)


# --- 2. a mixed load ----------------------------------------------------------------------------------------


def mixed(args: argparse.Namespace, log_dir: Path) -> tuple[str, bool]:
    prompts = load_prompts(limit=args.mixed_requests)
    config = engine_config(args, BUNDLED_DRAFT, max(1, len(prompts) // 2))
    reference = ar_texts(config, prompts, args.mixed_max_tokens)
    gateway = GatewaySettings(http_port=free_port(), per_request_spec_decode_metrics="summary")
    with GatewayStack(config, 2, gateway=gateway, log_dir=log_dir / "mixed") as stack:
        replies = asyncio.run(_mixed_requests(stack.http_url, prompts, args.mixed_max_tokens))
    rows, ok = ["| request | num_speculative_tokens | drafts | drafted tokens | accepted | output equals ar |",
                "|---|---|---|---|---|---|"], True  # fmt: skip
    for i, (reply, want) in enumerate(zip(replies, reference, strict=True)):
        counts = reply["metrics"]["speculative_decoding"]
        same = reply["choices"][0]["text"] == want
        capped = i % 2 == 0
        ok &= same and (counts["num_draft_tokens"] == 0) == capped
        rows.append(f"| {i} | {0 if capped else f'default ({args.k})'} | {counts['num_drafts']} | "
                    f"{counts['num_draft_tokens']} | {counts['num_accepted_tokens']} | {same} |")  # fmt: skip
    rows.append(f"\nevery capped request drafted nothing, every other drafted, all outputs equal ar: {ok}")
    return "\n".join(rows), ok


def ar_texts(config: EngineConfig, prompts: list[str], max_tokens: int) -> list[str]:
    """The target alone, in this process (plain autoregressive decoding, the strict kernels)."""
    from minedraft.engine.engine import LLMEngine
    from minedraft.sampling.params import SamplingParams

    engine = LLMEngine.local(config.model_copy(update={"speculative_config": None}))
    tokenizer = load_tokenizer(config.target_path)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.add_request(tokenizer.encode(p), params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    engine.executor.close()
    return [r.text for r in requests]


async def _mixed_requests(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(i: int, prompt: str) -> dict:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            if i % 2 == 0:
                body["num_speculative_tokens"] = 0
            async with session.post(f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                return await response.json()

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


# --- 3. groups of different speed ---------------------------------------------------------------------------


def useless_draft(root: Path) -> Path:
    """The bundled draft's architecture and tokenizer with random weights (each tensor's own scale kept)."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = root / "draft-random"
    shutil.copytree(BUNDLED_DRAFT, folder, dirs_exist_ok=True)
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    random = {name: (torch.randn(t.shape, generator=generator) * t.float().std().clamp_min(1e-3)).to(t.dtype)
              if t.ndim > 1 else t for name, t in weights.items()}  # fmt: skip
    save_file(random, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def speeds(args: argparse.Namespace, log_dir: Path) -> str:
    fast = engine_config(args, BUNDLED_DRAFT, args.speed_max_num_seqs)
    slow = engine_config(args, useless_draft(log_dir), args.speed_max_num_seqs)
    prompts = load_prompts(limit=args.speed_prompts)
    with ExitStack() as running:
        stack = running.enter_context(GatewayStack(fast, 2, group_configs=[fast, slow],
                                                   metrics_ports=[free_port(), free_port()],
                                                   gateway=GatewaySettings(http_port=free_port()),
                                                   log_dir=log_dir / "speeds"))  # fmt: skip
        urls = {policy: start_gateway(stack, running, policy, log_dir / f"gw-speeds-{policy}.log")
                for policy in ("least-work", "predicted")}  # fmt: skip
        served = lambda: [scrape(metrics_url(stack, g)).get("minedraft:request_success_total", 0.0)  # noqa: E731
                          for g in (0, 1)]  # fmt: skip
        shares: dict[str, list[list[float]]] = {policy: [] for policy in urls}

        def runner(policy: str) -> Callable[[int], BenchResult]:
            def run(_: int) -> BenchResult:
                before = served()
                result = run_online_bench(urls[policy], prompts, backend="openai", concurrency=args.speed_concurrency,
                                          max_tokens=args.speed_max_tokens, temperature=0.0, ignore_eos=True,
                                          progress=False, label=policy, percentiles=(50.0,))  # fmt: skip
                shares[policy].append([a - b for a, b in zip(served(), before)])
                return result

            return run

        for policy in urls:  # warm-up, and the groups' speeds measured for `predicted`
            runner(policy)(0)
            shares[policy].clear()
        rounds = interleaved({policy: runner(policy) for policy in urls}, args.rounds, settle_s=args.settle,
                             report=lambda r, name, res: print(f"   round {r + 1} {name}: {res.output_throughput:.0f} "
                                                               f"tok/s", flush=True))  # fmt: skip
    rows = ["| policy | output tok/s | TTFT p50 (ms) | E2EL p50 (ms) | requests to the bundled-draft group : the "
            "random-draft group |", "|---|---|---|---|---|"]  # fmt: skip
    best = {}
    for policy, results in rounds.items():
        run = median_by(results, lambda r: r.output_throughput)
        best[policy] = run.output_throughput
        split = [sum(s[g] for s in shares[policy]) for g in (0, 1)]
        rows.append(f"| {policy} | {run.output_throughput:.0f} | {_ms(run.ttft.median)} | {_ms(run.e2el.median)} | "
                    f"{split[0]:.0f} : {split[1]:.0f} |")  # fmt: skip
    ratio = best["predicted"] / best["least-work"]
    rows.append(f"\npredicted / least-work output tok/s: {ratio:.2f}x ({'above' if ratio > 1 else 'NOT above'})")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=lambda v: v.split(","), default=["multi-turn", "mixed", "speeds"],
                        help="comma-separated, of: multi-turn, mixed, speeds")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens of every group (fixed)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds idle before each timed run")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--first-tokens", type=int, default=192, help="each conversation's opening text")
    parser.add_argument("--user-tokens", type=int, default=24, help="each later user turn")
    parser.add_argument("--max-tokens", type=int, default=24, help="answer length per turn (greedy, EOS ignored)")
    parser.add_argument("--mixed-requests", type=int, default=8)
    parser.add_argument("--mixed-max-tokens", type=int, default=32)
    parser.add_argument("--speed-prompts", type=int, default=16)
    parser.add_argument("--speed-concurrency", type=int, default=8)
    parser.add_argument("--speed-max-tokens", type=int, default=48)
    parser.add_argument("--speed-max-num-seqs", type=int, default=4)
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the tables and goal lines here")
    args = parser.parse_args()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="minedraft-gateway-routing-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    report, ok = {}, True
    if "multi-turn" in args.parts:
        print("== 1. multi-turn chat over 2 groups, by policy", flush=True)
        report["multi-turn"], _ = multi_turn(args, log_dir)
        print(report["multi-turn"], flush=True)
    if "mixed" in args.parts:
        print("== 2. mixed load: half num_speculative_tokens 0, half default", flush=True)
        report["mixed"], same = mixed(args, log_dir)
        ok &= same
        print(report["mixed"], flush=True)
    if "speeds" in args.parts:
        print("== 3. predicted vs least-work, a bundled-draft group and a random-draft group", flush=True)
        report["speeds"] = speeds(args, log_dir)
        print(report["speeds"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"service logs: {log_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
