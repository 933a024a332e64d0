"""Offline benchmark: every decoding mode over the same prompts in one process, side by side."""

from __future__ import annotations

import time
from dataclasses import dataclass

from minedraft.config import SpeculativeConfig
from minedraft.engine.request import SpecDecodeStats
from minedraft.llm import LLM
from minedraft.sampling.params import SamplingParams


@dataclass
class ModeResult:
    name: str
    seconds: float
    output_tokens: int
    spec: SpecDecodeStats
    draft_seconds: float
    verify_seconds: float
    step_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def mode_configs(k: int) -> dict[str, dict | None]:
    """The modes compared, as speculative configs (None = autoregressive)."""
    return {
        "ar": None,
        "sd": {"num_speculative_tokens": k},
        "pearl": {"num_speculative_tokens": k, "is_parallel": True, "force_pearl": True},
        "minedraft": {"num_speculative_tokens": k, "is_parallel": True},
        "minedraft+tetris": {"num_speculative_tokens": k, "is_parallel": True, "tetris": True},
    }


def run_mode(
    name: str, spec: dict | None, prompts: list[str], params: SamplingParams, **engine_kwargs
) -> tuple[ModeResult, list[list[int]]]:
    llm = LLM(speculative_config=SpeculativeConfig.parse(spec), **engine_kwargs)
    try:
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up: first-call allocations, thread start
        llm.engine.step_stats = type(llm.engine.step_stats)()
        llm.engine.spec_stats = SpecDecodeStats()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)
        seconds = time.perf_counter() - start
        steps = llm.engine.step_stats
        tokens = [o.outputs[0].token_ids for o in outputs]
        result = ModeResult(
            name,
            seconds,
            sum(len(t) for t in tokens),
            llm.engine.spec_stats,
            steps.draft_seconds,
            steps.verify_seconds,
            steps.step_seconds,
        )
        return result, tokens
    finally:
        llm.close()


def format_table(results: list[ModeResult]) -> str:
    by_name = {r.name: r for r in results}
    rows = [
        f"{'mode':<18}{'tokens/s':>10}{'vs ar':>8}{'vs sd':>8}{'mean acc len':>14}{'draft s':>9}{'verify s':>10}"
    ]
    for r in results:
        vs_ar = r.tokens_per_second / by_name["ar"].tokens_per_second if "ar" in by_name else float("nan")
        vs_sd = r.tokens_per_second / by_name["sd"].tokens_per_second if "sd" in by_name else float("nan")
        acc = f"{r.spec.mean_accepted_length:.2f}" if r.spec.num_drafts else "-"
        rows.append(
            f"{r.name:<18}{r.tokens_per_second:>10.1f}{vs_ar:>8.2f}{vs_sd:>8.2f}{acc:>14}"
            f"{r.draft_seconds:>9.1f}{r.verify_seconds:>10.1f}"
        )
    return "\n".join(rows)


def run_offline_bench(
    prompts: list[str], modes: list[str], k: int, params: SamplingParams, **engine_kwargs
) -> list[ModeResult]:
    """Run each mode over the same prompts; greedy outputs must agree token for token with ar."""
    configs = mode_configs(k)
    unknown = [m for m in modes if m not in configs]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {list(configs)}")
    results, reference = [], None
    for name in modes:
        print(f"== {name}", flush=True)
        result, tokens = run_mode(name, configs[name], prompts, params, **engine_kwargs)
        results.append(result)
        if params.greedy and reference is not None and tokens != reference:
            print(f"warning: {name} greedy output differs from the first mode's", flush=True)
        reference = reference if reference is not None else tokens
    return results
