"""Offline benchmark: every decoding mode over the same prompts in one process, side by side.

All modes are loaded first, then timed round-robin for `repeats` rounds (ar, sd, ..., ar, sd, ...), and
each mode's median is reported. Interleaving spreads the machine's noise over all modes alike; the
ratios between modes are the numbers to read, not the absolute throughput.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from minedraft.bench.rounds import interleaved
from minedraft.config import SpeculativeConfig
from minedraft.engine.engine import StepStats
from minedraft.engine.request import SpecDecodeStats
from minedraft.llm import LLM
from minedraft.sampling.params import SamplingParams


@dataclass
class ModeResult:
    name: str
    output_tokens: int
    spec_stats: SpecDecodeStats
    seconds: list[float] = field(default_factory=list)  # one per round
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / statistics.median(self.seconds)


# The keys that make a mode; every other speculative key (k, draft model, Tetris knobs) the modes share.
MODE_KEYS = ("is_parallel", "force_pearl", "tetris", "parallel_drafting", "method")


def mode_configs(shared: dict) -> dict[str, dict | None]:
    """The modes compared, as speculative configs (None = autoregressive); `shared` holds the keys they
    have in common, e.g. {"num_speculative_tokens": 4}."""
    shared = {key: value for key, value in shared.items() if key not in MODE_KEYS}
    return {
        "ar": None,
        "sd": dict(shared),
        "pearl": {**shared, "is_parallel": True, "force_pearl": True},
        "minedraft": {**shared, "is_parallel": True},
        "minedraft+tetris": {**shared, "is_parallel": True, "tetris": True},
        "sd+pard": {**shared, "parallel_drafting": True},
        "minedraft+pard": {**shared, "is_parallel": True, "parallel_drafting": True},
        "sd+eagle3": {**shared, "method": "eagle3"},
        "pearl+eagle3": {**shared, "is_parallel": True, "force_pearl": True, "method": "eagle3"},
        "minedraft+eagle3": {**shared, "is_parallel": True, "method": "eagle3"},
        "sd+p-eagle": {**shared, "method": "eagle3", "parallel_drafting": True},
        "minedraft+p-eagle": {**shared, "is_parallel": True, "method": "eagle3", "parallel_drafting": True},
    }


def _timed_run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list[list[int]], StepStats]:
    llm.engine.step_stats = StepStats()
    llm.engine.spec_stats = SpecDecodeStats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [o.outputs[0].token_ids for o in outputs], llm.engine.step_stats


def format_table(results: list[ModeResult]) -> str:
    by_name = {r.name: r for r in results}
    header = f"{'mode':<18}{'tokens/s':>10}{'vs ar':>8}{'vs sd':>8}{'mean acc len':>14}{'draft s':>9}{'verify s':>10}"
    rows = [header]
    for r in results:
        vs_ar = r.tokens_per_second / by_name["ar"].tokens_per_second if "ar" in by_name else float("nan")
        vs_sd = r.tokens_per_second / by_name["sd"].tokens_per_second if "sd" in by_name else float("nan")
        acc = f"{r.spec_stats.mean_accepted_length:.2f}" if r.spec_stats.num_drafts else "-"
        rows.append(
            f"{r.name:<18}{r.tokens_per_second:>10.1f}{vs_ar:>8.2f}{vs_sd:>8.2f}{acc:>14}"
            f"{statistics.median(r.draft_seconds):>9.2f}{statistics.median(r.verify_seconds):>10.2f}"
        )
    rounds = len(results[0].seconds) if results else 0
    rows.append(f"(medians over {rounds} interleaved rounds; draft/verify s: time inside each stage per round)")
    return "\n".join(rows)


def run_offline_bench(
    prompts: list[str], modes: list[str], speculative: dict, params: SamplingParams, repeats: int = 3, **engine_kwargs
) -> list[ModeResult]:
    """Time each mode over the same prompts; in greedy mode every output must equal the first mode's.
    `speculative`: the speculative keys the modes share (see `mode_configs`)."""
    configs = mode_configs(speculative)
    unknown = [m for m in modes if m not in configs]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {list(configs)}")
    llms = {name: LLM(speculative_config=SpeculativeConfig.parse(configs[name]), **engine_kwargs) for name in modes}
    try:
        for llm in llms.values():  # warm-up: first-call allocations, thread start
            llm.generate(prompts[:2], params, use_tqdm=False)
        reference: list[list[list[int]]] = []  # the first mode's first output: every greedy output must equal it

        def timed(name: str, llm: LLM) -> Callable[[int], tuple]:
            def run(_round: int) -> tuple:
                seconds, tokens, steps = _timed_run(llm, prompts, params)
                if params.greedy and reference and tokens != reference[0]:
                    print(f"warning: {name} greedy output differs from {modes[0]}'s", flush=True)
                reference[:] = reference or [tokens]
                return seconds, tokens, steps

            return run

        runs = interleaved({name: timed(name, llm) for name, llm in llms.items()}, repeats,
                           report=lambda r, name, _: print(f"round {r + 1}/{repeats}: {name}", flush=True))
        results = []
        for name in modes:
            result = ModeResult(name, sum(len(t) for t in runs[name][0][1]), llms[name].engine.spec_stats)
            for seconds, _, steps in runs[name]:
                result.seconds.append(seconds)
                result.draft_seconds.append(steps.draft_seconds)
                result.verify_seconds.append(steps.verify_seconds)
            results.append(result)
        return results
    finally:
        for llm in llms.values():
            llm.close()
