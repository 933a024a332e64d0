"""Server-side step statistics of a benchmark run, from the scheduler's Prometheus endpoint.

The scheduler exposes per-step histograms (`minedraft:step_seconds`, `minedraft:draft_step_seconds`,
`minedraft:verify_step_seconds`, `minedraft:step_overlap_ratio`). A benchmark scrapes them before and
after its run; the difference of each histogram's `_sum` and `_count` covers exactly the steps of the
run (provided nothing else is using the server meanwhile).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from minedraft.metrics import (  # scrape: re-exported for the benchmarks
    CHOSEN_K,
    DRAFT_STEP_SECONDS,
    GENERATION_TOKENS,
    NUM_ACCEPTED_TOKENS,
    NUM_DRAFTS,
    PLAIN_STEPS,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    STEP_OVERLAP_RATIO,
    STEP_SECONDS,
    VERIFY_STEP_SECONDS,
    WORKER_IDLE_SECONDS,
    WORKER_STEP_SECONDS,
    Samples,
    scrape,  # noqa: F401
)

STEP, DRAFT, VERIFY, OVERLAP = STEP_SECONDS, DRAFT_STEP_SECONDS, VERIFY_STEP_SECONDS, STEP_OVERLAP_RATIO
NUM_ACCEPTED, WORKER_STEP, WORKER_IDLE = NUM_ACCEPTED_TOKENS, WORKER_STEP_SECONDS, WORKER_IDLE_SECONDS
ROLES = ("verifier", "drafter")
_MAX_K = 32  # num_speculative_tokens' bound

ACCEPTED_PER_POS = "minedraft:spec_decode_num_accepted_tokens_per_pos"


def _trimmed(counts: list[int]) -> list[int]:
    """Without the trailing positions nothing was accepted at."""
    while counts and not counts[-1]:
        counts.pop()
    return counts


def _delta(before: Samples, after: Samples, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


@dataclass
class ServerStepStats:
    """What the scheduler measured during the run. Times are in seconds.

    - `steps`: engine steps (one round trip to the workers each; in SD, drafting and verifying are
      separate steps, in MineDraft one step drafts one batch while verifying the other).
    - `draft_steps` / `verify_steps`: steps that drafted / verified anything; `overlap_steps`: both.
    - the `*_sum` fields: summed step, draft and verify times, and the summed per-step ratio
      max(draft, verify) / step time over the overlap steps.
    """

    steps: int
    step_seconds_sum: float
    draft_steps: int
    draft_seconds_sum: float
    verify_steps: int
    verify_seconds_sum: float
    overlap_steps: int
    overlap_ratio_sum: float
    num_drafts: int  # verifications carrying drafts (one per request per verify step)
    num_accepted_tokens: int
    generation_tokens: int
    worker_step_seconds_sum: dict[str, float] = field(default_factory=dict)  # per worker role
    worker_idle_seconds_sum: dict[str, float] = field(default_factory=dict)
    chosen_k: dict[int, int] = field(default_factory=dict)  # adaptive speculation: windows per chosen k
    plain_steps: int = 0  # adaptive speculation's steps that drafted nothing
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted draft tokens by position in the window
    prefix_cache_queries: int = 0  # prompt tokens the verifier looked up in its prefix cache
    prefix_cache_hits: int = 0  # and found there

    @classmethod
    def from_scrapes(cls, before: Samples, after: Samples) -> ServerStepStats:
        def count(name: str) -> int:
            return round(_delta(before, after, name))

        return cls(
            steps=count(STEP + "_count"),
            step_seconds_sum=_delta(before, after, STEP + "_sum"),
            draft_steps=count(DRAFT + "_count"),
            draft_seconds_sum=_delta(before, after, DRAFT + "_sum"),
            verify_steps=count(VERIFY + "_count"),
            verify_seconds_sum=_delta(before, after, VERIFY + "_sum"),
            overlap_steps=count(OVERLAP + "_count"),
            overlap_ratio_sum=_delta(before, after, OVERLAP + "_sum"),
            num_drafts=count(NUM_DRAFTS + "_total"),
            num_accepted_tokens=count(NUM_ACCEPTED + "_total"),
            generation_tokens=count(GENERATION_TOKENS + "_total"),
            worker_step_seconds_sum={r: _delta(before, after, f"{WORKER_STEP}_sum{{{r}}}") for r in ROLES},
            worker_idle_seconds_sum={r: _delta(before, after, f"{WORKER_IDLE}_sum{{{r}}}") for r in ROLES},
            chosen_k={k: n for k in range(_MAX_K + 1) if (n := count(f"{CHOSEN_K}_total{{{k}}}"))},
            plain_steps=count(PLAIN_STEPS + "_total"),
            accepted_per_pos=_trimmed([count(f"{ACCEPTED_PER_POS}_total{{{i}}}") for i in range(_MAX_K)]),
            prefix_cache_queries=count(PREFIX_CACHE_QUERIES + "_total"),
            prefix_cache_hits=count(PREFIX_CACHE_HITS + "_total"),
        )

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Share of the admitted prompt tokens the verifier's prefix cache held (vLLM's hit rate)."""
        return _ratio(self.prefix_cache_hits, self.prefix_cache_queries)

    @property
    def mean_chosen_k(self) -> float | None:
        """Adaptive speculation: the mean k of the windows it chose (0 counts: requests decoded plainly)."""
        return _ratio(sum(k * n for k, n in self.chosen_k.items()), sum(self.chosen_k.values()))

    @property
    def worker_idle_share(self) -> dict[str, float]:
        """Per worker: its wait for plans as a share of its time while requests ran (wait + compute). The
        bubble the step protocol leaves; on GPUs, the GPU's idle time."""
        shares = {}
        for role in ROLES:
            idle, busy = self.worker_idle_seconds_sum.get(role, 0.0), self.worker_step_seconds_sum.get(role, 0.0)
            if idle + busy > 0:
                shares[role] = idle / (idle + busy)
        return shares

    @property
    def mean_step_seconds(self) -> float | None:
        """Mean wall time of a step as the scheduler saw it (RPCs to the workers included)."""
        return _ratio(self.step_seconds_sum, self.steps)

    @property
    def mean_draft_seconds(self) -> float | None:
        """Mean drafter time over the steps that drafted (measured in the drafter process)."""
        return _ratio(self.draft_seconds_sum, self.draft_steps)

    @property
    def mean_verify_seconds(self) -> float | None:
        """Mean verifier time over the steps that verified (measured in verifier rank 0)."""
        return _ratio(self.verify_seconds_sum, self.verify_steps)

    @property
    def overlap_efficiency(self) -> float | None:
        """Mean of max(draft, verify) / step time over the steps that ran both (None if none did).

        1.0 means drafting was fully hidden behind verification (or the reverse) and the step cost
        nothing beyond its longer half; lower means time lost to the shorter half not overlapping,
        to contention between the two, or to the control plane. An unweighted mean over steps.
        """
        return _ratio(self.overlap_ratio_sum, self.overlap_steps)

    @property
    def control_plane_overhead(self) -> float | None:
        """Share of step time not spent in the longer of drafting and verifying: an approximation.

        Wanted: 1 - sum_steps max(draft, verify) / sum_steps step_time, i.e. the time the scheduler's
        planning, the RPCs and (for steps that ran both) imperfect overlap add on top of the model work.
        The histograms only give sums, so sum_steps max(draft, verify) is estimated as:

        - single-phase steps (draft only or verify only, all steps of `ar` and `sd`): max is that phase.
          Their phase time is the phase sum scaled by the share of its steps that ran alone, which
          assumes a phase takes as long on average in an overlapped step as in a lone one;
        - overlap steps: the mean overlap ratio times their step time, taken as the mean step time,
          i.e. `overlap_ratio_sum * step_seconds_sum / steps`.

        Exact when no step ran both phases (ar, sd); equal to 1 - the unweighted mean overlap ratio
        when every step ran both. Between those (MineDraft's ramp-up and tail) it is an estimate.
        """
        if not self.steps or not self.step_seconds_sum:
            return None
        alone = 0.0
        if self.draft_steps:
            alone += self.draft_seconds_sum * (self.draft_steps - self.overlap_steps) / self.draft_steps
        if self.verify_steps:
            alone += self.verify_seconds_sum * (self.verify_steps - self.overlap_steps) / self.verify_steps
        overlapped = self.overlap_ratio_sum * self.step_seconds_sum / self.steps
        return 1.0 - (alone + overlapped) / self.step_seconds_sum

    @property
    def acceptance_per_position(self) -> list[float]:
        """Per draft position: the share of verifications carrying drafts that accepted it, from the server's
        counters (so over any protocol)."""
        return [n / self.num_drafts for n in self.accepted_per_pos] if self.num_drafts else []

    @property
    def mean_accepted_length(self) -> float | None:
        """1 + accepted draft tokens per verification that carried drafts, from the server's counters."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def to_dict(self) -> dict[str, Any]:
        derived = {
            name: getattr(self, name)
            for name in (
                "mean_step_seconds",
                "mean_draft_seconds",
                "mean_verify_seconds",
                "overlap_efficiency",
                "control_plane_overhead",
                "mean_accepted_length",
                "worker_idle_share",
                "mean_chosen_k",
                "acceptance_per_position",
                "prefix_cache_hit_rate",
            )
        }
        return {**asdict(self), **derived}
