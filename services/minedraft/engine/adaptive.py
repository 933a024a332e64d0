"""Adaptive speculation: how many tokens each request drafts in each step, from what was measured here.

Two online models (docs/engine.md, "Adaptive speculation"):

- acceptance: the chance that the draft token at position j is accepted when every one before it was,
  from decayed counts over all verifications, scaled per request by its own acceptance so far (shrunk
  towards the global figure while it has few verifications);
- cost: the seconds of a verify part as a + c x requests + b x target tokens, of a draft part as
  c' x draft forwards + d x draft tokens, and each step's overhead beyond its slower part (planning,
  transport, the engine's bookkeeping: the time between two steps' ends less the slower part); least
  squares with forgetting over the work the workers report (StepResult), so nothing is tuned for one machine.

Each time a batch is drafted the controller takes the k in 0..max that maximises expected tokens per
second for the mode's step shape, then trims each request's window where its next token is expected to
be worth less than it costs. k = 0 is plain decoding. The choice reads only verifications already made,
never the token about to be sampled, so every output stays exactly the target's. Requests that sample with
a seed keep the fixed k, so that their text is the same on every run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from minedraft.engine.plans import StepResult
from minedraft.engine.request import Request

_DECAY = 0.98  # forgetting per step: the last ~50 steps carry the fits
_WARMUP_STEPS = 4  # draft and verify parts seen before the cost fits are trusted (until then: k = max)
# One decision in this many drafts the most it may or nothing, in turn: the two ends of the range keep the
# cost fits anchored (a fit fed only the shape it chose extrapolates badly, and would stay where it is).
_PROBE_EVERY = 16
_REQUEST_PRIOR = 8.0  # verifications' weight of the global acceptance in a request's own estimate
_MAX_ACCEPT = 0.995


class _Fit:
    """y ~ w . x by least squares on relative error (weight 1 / y^2) with exponential forgetting, every weight
    kept >= 0. Relative error, so that a long step does not outweigh the short ones the choice of k is about;
    a touch of ridge, so that features that have not varied apart yet share their cost instead of failing."""

    def __init__(self, features: int) -> None:
        self.xx = [[0.0] * features for _ in range(features)]
        self.xy = [0.0] * features
        self.count = 0

    def add(self, x: Sequence[float], y: float) -> None:
        w = 1.0 / (y * y)
        for i, xi in enumerate(x):
            self.xy[i] = self.xy[i] * _DECAY + w * xi * y
            for j, xj in enumerate(x):
                self.xx[i][j] = self.xx[i][j] * _DECAY + w * xi * xj
        self.count += 1

    def weights(self) -> list[float]:
        """Non-negative least squares by elimination: drop the most negative weight and solve again."""
        active = list(range(len(self.xy)))
        while active:
            solution = _solve([[self.xx[i][j] for j in active] for i in active], [self.xy[i] for i in active])
            if solution is not None and min(solution) >= 0:
                weights = [0.0] * len(self.xy)
                for i, value in zip(active, solution):
                    weights[i] = value
                return weights
            active.pop(solution.index(min(solution)) if solution is not None else 0)
        return [0.0] * len(self.xy)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """(A + ridge) w = b by Gaussian elimination with partial pivoting; None if A is empty or zero."""
    n = len(b)
    ridge = 1e-6 * sum(a[i][i] for i in range(n))
    if ridge <= 0:
        return None
    m = [[a[i][j] + (ridge if i == j else 0.0) for j in range(n)] + [b[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            m[r] = [v - factor * p for v, p in zip(m[r], m[col])]
    w = [0.0] * n
    for i in reversed(range(n)):
        w[i] = (m[i][n] - sum(m[i][j] * w[j] for j in range(i + 1, n))) / m[i][i]
    return w


class Acceptance:
    """Per draft position j: the chance it is accepted when positions 0..j-1 were (decayed counts)."""

    def __init__(self, max_k: int) -> None:
        self.reached = [0.0] * max_k
        self.accepted = [0.0] * max_k

    def decay(self) -> None:
        self.reached = [n * _DECAY for n in self.reached]
        self.accepted = [n * _DECAY for n in self.accepted]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        for j in range(min(num_accepted + 1, num_drafts, len(self.reached))):
            self.reached[j] += 1
            self.accepted[j] += j < num_accepted

    def conditional(self) -> list[float]:
        """Each position's estimate, leaning on the position before it while it has few counts."""
        rates, prior = [], 0.5
        for reached, accepted in zip(self.reached, self.accepted):
            prior = (accepted + 2 * prior) / (reached + 2)
            rates.append(prior)
        return rates

    def overall(self) -> float:
        """Accepted over reached, all positions together."""
        return (sum(self.accepted) + 1) / (sum(self.reached) + 2)


@dataclass(frozen=True)
class Costs:
    """The fitted cost of one step's parts, in seconds, as of one decision (the fits solved once)."""

    verify: list[float]  # a, c, b: seconds per step, per request, per token
    draft: list[float]  # c', d: seconds per forward, per token
    overhead: float
    one_forward_drafts: bool  # PARD: a window takes one forward

    def verify_seconds(self, requests: float, tokens: float) -> float:
        a, per_request, per_token = self.verify
        return a + per_request * requests + per_token * tokens

    def draft_seconds(self, windows: Sequence[int]) -> float:
        if not any(windows):
            return 0.0
        forwards = 1 if self.one_forward_drafts else max(windows)
        drafting = sum(1 for w in windows if w)  # each also feeds the drafter its pending token(s) first
        per_forward, per_token = self.draft
        return per_forward * forwards + per_token * (sum(windows) + drafting)


def _seeded_sampling(request: Request) -> bool:
    return request.params.seed is not None and request.params.temperature > 0


class SpeculationController:
    """Chooses each drafted request's k for one pipeline (see the module docstring).

    `overlapped`: drafting runs beside verification (PEARL, MineDraft), so a step costs its slower part;
    otherwise (SD) a speculative round costs a draft step and a verify step."""

    def __init__(self, max_k: int, overlapped: bool, one_forward_drafts: bool) -> None:
        self.max_k = max_k
        self.overlapped = overlapped
        self.acceptance = Acceptance(max_k)
        # verify: a + c x requests + b x tokens (a request costs its attention over its context and its
        # bookkeeping whatever its window); draft: c x forwards + d x tokens.
        self._verify, self._draft = _Fit(3), _Fit(2)
        self._overhead_sums = (0.0, 0.0)  # decayed sum of the samples, decayed count
        self._one_forward = one_forward_drafts
        self._last_end: float | None = None
        self.last_k: list[int] = []  # the windows of the last decision
        # Over the controller's life, for the metrics and the tests: windows chosen (k -> request windows),
        # decisions, and decisions that drafted nothing (plain decoding).
        self.windows: Counter[int] = Counter()
        self.num_decisions = 0
        self.num_plain = 0

    def observe(self, result: StepResult) -> None:
        """Learn from one step's results: acceptance per position, and what its parts cost."""
        self.acceptance.decay()
        for verified in result.verified:
            if verified.num_draft_tokens:
                self.acceptance.record(verified.num_draft_tokens, verified.num_accepted)
        # Only decoding steps teach the fits: a step that prefilled a prompt costs what attention over a whole
        # prompt costs, not what the next window will (prompts would pull the per-token cost their way).
        window = 2 * (self.max_k + 1)  # the most tokens a decoding request feeds a model in one step
        decoding_verify = 0 < result.verify_tokens <= window * len(result.verified)
        if decoding_verify and result.verify_seconds > 0:
            self._verify.add((1.0, len(result.verified), result.verify_tokens), result.verify_seconds)
        decoding_draft = 0 < result.draft_tokens <= window * len(result.drafted)
        if result.draft_forwards and decoding_draft and result.draft_seconds > 0:
            self._draft.add((result.draft_forwards, result.draft_tokens), result.draft_seconds)
        now, last = time.perf_counter(), self._last_end
        self._last_end = now
        slower = max(result.draft_seconds, result.verify_seconds)
        if last is not None and slower > 0:
            # Capped, so that time the engine sat idle between requests does not count as overhead.
            between = min(now - last, 2 * max(result.step_seconds, slower))
            self._overhead_sums = (self._overhead_sums[0] * _DECAY + max(0.0, between - slower),
                                   self._overhead_sums[1] * _DECAY + 1)

    @property
    def warmed_up(self) -> bool:
        return self._verify.count >= _WARMUP_STEPS and self._draft.count >= _WARMUP_STEPS

    def choose(self, requests: Sequence[Request], caps: Sequence[int], others: int = 0) -> list[int]:
        """Draft tokens for each of `requests` (at most its cap); all zero: this step is plain decoding.

        `others`: requests running in the other batch (MineDraft), which a plain step would decode too."""
        decision = self.num_decisions + 1
        if not self.warmed_up:
            windows = list(caps)
        elif decision % _PROBE_EVERY == 0:
            windows = [min(self._probe_k(decision), cap) for cap in caps]
        else:
            costs = self._costs()
            survival = self._survival(requests)
            best, rate = self._best_k(costs, survival, caps, others)
            windows = self._trim(costs, [min(best, cap) for cap in caps], survival, rate) if best else [0] * len(caps)
        # A seed asks for the same text on every run; a sampled token depends on where its window starts,
        # and windows chosen from timings differ between runs: seeded sampling keeps the fixed k.
        windows = [cap if _seeded_sampling(r) else w for r, w, cap in zip(requests, windows, caps)]
        self.last_k = windows
        self.windows.update(windows)
        self.num_decisions += 1
        self.num_plain += not any(windows)
        return windows

    def _probe_k(self, decision: int) -> int:
        """The most, or nothing, in turn."""
        return self.max_k if decision % (2 * _PROBE_EVERY) else 0

    def _survival(self, requests: Sequence[Request]) -> list[list[float]]:
        """For each request, the chance that each of its first max_k draft tokens is accepted."""
        overall, rates = self.acceptance.overall(), self.acceptance.conditional()
        survival = []
        for request in requests:
            accepted = request.stats.num_accepted_tokens
            own = (accepted + _REQUEST_PRIOR * overall) / (accepted + request.num_rejections + _REQUEST_PRIOR)
            scale, chance, chances = own / overall, 1.0, []
            for rate in rates:
                chance *= min(_MAX_ACCEPT, rate * scale)
                chances.append(chance)
            survival.append(chances)
        return survival

    def _costs(self) -> Costs:
        total, count = self._overhead_sums
        return Costs(self._verify.weights(), self._draft.weights(), total / count if count else 0.0,
                     self._one_forward)  # fmt: skip

    def _rate(self, costs: Costs, windows: list[int], survival: list[list[float]], others: int) -> float:
        """Expected tokens per second of a step shape with these windows (all zero: plain decoding)."""
        count = len(windows)
        if not any(windows):
            everyone = count + others
            return everyone / max(1e-9, costs.verify_seconds(everyone, everyone) + costs.overhead)
        tokens = count + sum(sum(s[:k]) for s, k in zip(survival, windows))
        verify = costs.verify_seconds(count, count + sum(windows))
        draft = costs.draft_seconds(windows)
        seconds = max(draft, verify) + costs.overhead if self.overlapped else draft + verify + 2 * costs.overhead
        return tokens / max(1e-9, seconds)

    def _best_k(self, costs: Costs, survival: list[list[float]], caps: Sequence[int],
                others: int) -> tuple[int, float]:
        """The uniform k (capped per request) with the most expected tokens per second, and that rate."""
        rates = [(self._rate(costs, [min(k, cap) for cap in caps], survival, others), -k)
                 for k in range(self.max_k + 1)]
        rate, neg_k = max(rates)
        return -neg_k, rate

    def _trim(self, costs: Costs, windows: list[int], survival: list[list[float]], rate: float) -> list[int]:
        """Shorten each window while its last token is expected to bring less than its cost at `rate`
        (dropping a token worth s that costs c seconds raises tokens/second exactly when s < rate x c)."""
        draft_per_token, verify_per_token = costs.draft[1], costs.verify[2]
        if self.overlapped:  # the slower part is what an extra token lengthens
            slower_is_draft = costs.draft_seconds(windows) >= costs.verify_seconds(len(windows),
                                                                                len(windows) + sum(windows))
            per_token = draft_per_token if slower_is_draft else verify_per_token
        else:
            per_token = draft_per_token + verify_per_token
        trimmed = []
        for window, chances in zip(windows, survival):
            while window and chances[window - 1] < rate * per_token:
                window -= 1
            trimmed.append(window)
        return trimmed
