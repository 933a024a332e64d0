"""`minedraft bench --launch`: one local stack per decoding mode, the same online load on each."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from minedraft.bench.offline import mode_configs
from minedraft.bench.online import BenchResult, run_online_bench
from minedraft.bench.rounds import interleaved, median_by
from minedraft.config import EngineConfig
from minedraft.stack.local import LocalStack, free_port, scheduler_settings


def run_launch_bench(
    modes: Sequence[str],
    speculative: dict[str, Any],
    engine_kwargs: dict[str, Any],
    prompts: Sequence[str],
    *,
    log_dir: Path,
    log_level: str = "INFO",
    repeats: int = 1,
    **bench_kwargs: Any,
) -> dict[str, BenchResult]:
    """Start one LocalStack per mode (own ports, Prometheus on a free port), all at once, then run
    `run_online_bench` over `prompts` for every mode in turn, `repeats` rounds, and keep each mode's
    median-throughput round. Interleaving spreads the machine's noise over the modes alike (an idle
    stack costs no CPU). Service logs go to `log_dir/<mode>/`.
    `speculative`: the speculative keys the modes share (see `mode_configs`)."""
    configs = mode_configs(speculative)
    unknown = [m for m in modes if m not in configs]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {list(configs)}")
    # Validate every mode's config before starting anything, so a typo fails in a second, not a stack later.
    engines = {m: EngineConfig(**engine_kwargs, speculative_config=configs[m]) for m in modes}
    with ExitStack() as running:
        stacks = {}
        for mode, config in engines.items():
            print(f"== {mode}: starting the stack (logs in {log_dir / mode})", flush=True)
            (log_dir / mode).mkdir(parents=True, exist_ok=True)
            metrics_port = free_port()
            settings = scheduler_settings(metrics_port=metrics_port)
            stack = LocalStack(config, scheduler=settings, log_dir=log_dir / mode, log_level=log_level)
            stacks[mode] = (running.enter_context(stack), f"http://127.0.0.1:{metrics_port}/metrics")

        def runner(stack: LocalStack, url: str, mode: str) -> Callable[[int], BenchResult]:
            return lambda _: run_online_bench(stack.address, prompts, metrics_url=url, label=mode, **bench_kwargs)

        def report(round_: int, mode: str, result: BenchResult) -> None:
            print(f"   round {round_ + 1}/{repeats} {mode}: {len(result.ok)} ok, {result.failed} failed, "
                  f"{result.output_throughput:.1f} tok/s", flush=True)  # fmt: skip

        runners = {mode: runner(stack, url, mode) for mode, (stack, url) in stacks.items()}
        rounds = interleaved(runners, repeats, alternate=False, report=report)
    return {mode: median_by(results, lambda r: r.output_throughput) for mode, results in rounds.items()}


def greedy_mismatches(results: dict[str, BenchResult]) -> dict[str, int]:
    """Per mode, how many requests' tokens differ from the first mode's (greedy decoding is lossless,
    so at temperature 0 every mode should produce the same tokens). Failed requests are skipped."""
    names = list(results)
    if not names:
        return {}
    reference = {r.index: r.token_ids for r in results[names[0]].ok}
    counts = {}
    for name in names[1:]:
        counts[name] = sum(1 for r in results[name].ok if r.index in reference and r.token_ids != reference[r.index])
    return counts


def _ratio(value: float, base: float | None) -> str:
    if base is None or not base or math.isnan(base) or math.isnan(value):
        return "-"
    return f"{value / base:.2f}"


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


COLUMNS = (
    ("mode", "<18"), ("ok/fail", ">8"), ("req/s", ">7"), ("tok/s", ">8"), ("x ar", ">6"), ("x sd", ">6"),
    ("E2EL ms", ">8"), ("x ar", ">6"), ("x sd", ">6"), ("TTFT ms", ">9"), ("TPOT ms", ">8"), ("ITL ms", ">8"),
    ("acc len", ">8"),
    ("overhead", ">9"), ("overlap", ">8"),
)  # fmt: skip

LEGEND = """\
tok/s: output tokens per second over the run; x ar / x sd after it: this mode's tok/s divided by ar's / sd's
E2EL ms: mean end-to-end request latency; x ar / x sd after it: divided by ar's / sd's (below 1 = faster)
TTFT / TPOT / ITL: means at the client, as vLLM defines them: time to first token, time per output token
after the first, gap between streamed chunks (a chunk holds a step's tokens: one, or an accepted burst)
acc len: mean accepted length, 1 + accepted / drafts over all requests (- without speculation)
overhead: share of scheduler step time outside max(draft, verify), approximate (see benchmarks/README.md)
overlap: mean max(draft, verify) / step time over steps that drafted and verified (- if none did)"""


def format_comparison(results: dict[str, BenchResult]) -> str:
    """One row per mode, with throughput and latency ratios against `ar` and `sd` when they ran."""
    base_tput = {m: results[m].output_throughput for m in ("ar", "sd") if m in results}
    base_e2e = {m: results[m].e2el.mean for m in ("ar", "sd") if m in results}
    header = "".join(format(name, fmt) for name, fmt in COLUMNS)
    rows = [header, "-" * len(header)]
    for mode, r in results.items():
        server = r.server
        cells = [
            mode, f"{len(r.ok)}/{r.failed}", f"{r.request_throughput:.2f}", f"{r.output_throughput:.1f}",
            _ratio(r.output_throughput, base_tput.get("ar")), _ratio(r.output_throughput, base_tput.get("sd")),
            f"{r.e2el.mean * 1e3:.0f}", _ratio(r.e2el.mean, base_e2e.get("ar")),
            _ratio(r.e2el.mean, base_e2e.get("sd")), f"{r.ttft.mean * 1e3:.0f}", f"{r.tpot.mean * 1e3:.1f}",
            f"{r.itl.mean * 1e3:.1f}", _opt(r.mean_accepted_length, ".2f"),
            _opt(server.control_plane_overhead if server else None, ".1%"),
            _opt(server.overlap_efficiency if server else None, ".2f"),
        ]  # fmt: skip
        rows.append("".join(format(cell, fmt) for cell, (_, fmt) in zip(cells, COLUMNS)))
    return "\n".join(rows) + "\n\n" + LEGEND
