"""Adaptive speculation: how many tokens each request drafts in each step, from what was measured here.

Two online models (docs/engine.md, "Adaptive speculation"):

- acceptance: the chance that the draft token at position j is accepted when every one before it was,
  from decayed counts over all verifications, scaled per request by its own acceptance so far (shrunk
  towards the global figure while it has few verifications);
- cost: the seconds of a verify part as a + b x target tokens, of a draft part as c x draft forwards +
  d x draft tokens, and each step's overhead beyond its slower part (planning, transport, the engine's
  bookkeeping: the time between two steps' ends less the slower part); least squares with forgetting over
  the work the workers report (StepResult), so nothing is tuned for one machine.

Each time a batch is drafted the controller takes the k in 0..max that maximises expected tokens per
second for the mode's step shape, then trims each request's window where its next token is expected to
be worth less than it costs. k = 0 is plain decoding. The choice reads only verifications already made,
never the token about to be sampled, so every output stays exactly the target's.
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
_PROBE_EVERY = 16  # one decision in this many tries k one off the best, so the fits keep seeing variety
_REQUEST_PRIOR = 8.0  # verifications' weight of the global acceptance in a request's own estimate
_MAX_ACCEPT = 0.995


class _Fit:
    """y ~ w0 * x0 + w1 * x1 by least squares on relative error (weight 1 / y^2) with exponential forgetting;
    both weights kept >= 0. Relative error, so that a prompt's prefill (many tokens, seconds) does not outweigh
    the decoding steps (few tokens, milliseconds) that the choice of k is about."""

    def __init__(self) -> None:
        self.xx = [0.0, 0.0, 0.0]  # sums of x0 x0, x0 x1, x1 x1
        self.xy = [0.0, 0.0]
        self.count = 0

    def add(self, x0: float, x1: float, y: float) -> None:
        w = 1.0 / (y * y)
        self.xx = [s * _DECAY + w * v for s, v in zip(self.xx, (x0 * x0, x0 * x1, x1 * x1))]
        self.xy = [s * _DECAY + w * v for s, v in zip(self.xy, (x0 * y, x1 * y))]
        self.count += 1

    def weights(self) -> tuple[float, float]:
        a, b, d = self.xx
        det = a * d - b * b
        if det > 1e-3 * a * d:  # the two features vary apart enough to tell their costs apart
            w0 = (d * self.xy[0] - b * self.xy[1]) / det
            w1 = (a * self.xy[1] - b * self.xy[0]) / det
            if w0 >= 0 and w1 >= 0:
                return w0, w1
            if w1 < 0:  # noise: tokens cost nothing measurable here
                return max(0.0, self.xy[0] / a), 0.0
        # Too little variety: charge it all to x1, the tokens, which overstates what more tokens cost and
        # so errs towards drafting less.
        return 0.0, (max(0.0, self.xy[1] / d) if d > 0 else 0.0)

    def __call__(self, x0: float, x1: float) -> float:
        w0, w1 = self.weights()
        return w0 * x0 + w1 * x1


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
    """The fitted cost of one step's parts, in seconds."""

    verify: _Fit
    draft: _Fit
    overhead: float
    one_forward_drafts: bool  # PARD: a window takes one forward

    def verify_seconds(self, tokens: float) -> float:
        return self.verify(1.0, tokens)

    def draft_seconds(self, windows: Sequence[int]) -> float:
        if not any(windows):
            return 0.0
        forwards = 1 if self.one_forward_drafts else max(windows)
        return self.draft(forwards, sum(windows))


class SpeculationController:
    """Chooses each drafted request's k for one pipeline (see the module docstring).

    `overlapped`: drafting runs beside verification (PEARL, MineDraft), so a step costs its slower part;
    otherwise (SD) a speculative round costs a draft step and a verify step."""

    def __init__(self, max_k: int, overlapped: bool, one_forward_drafts: bool) -> None:
        self.max_k = max_k
        self.overlapped = overlapped
        self.acceptance = Acceptance(max_k)
        self._verify, self._draft = _Fit(), _Fit()
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
        if result.verify_tokens and result.verify_seconds > 0:
            self._verify.add(1.0, result.verify_tokens, result.verify_seconds)
        if result.draft_forwards and result.draft_seconds > 0:
            self._draft.add(result.draft_forwards, result.draft_tokens, result.draft_seconds)
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
            survival = [self._survival(r) for r in requests]
            best, rate = self._best_k(survival, caps, others)
            windows = self._trim([min(best, cap) for cap in caps], survival, rate) if best else [0] * len(caps)
        self.last_k = windows
        self.windows.update(windows)
        self.num_decisions += 1
        self.num_plain += not any(windows)
        return windows

    def _probe_k(self, decision: int) -> int:
        """One off the last choice, up or down in turn (up from 0, down from max)."""
        last = max(self.last_k, default=0)
        up = last < self.max_k and (last == 0 or decision % (2 * _PROBE_EVERY) != 0)
        return last + 1 if up else last - 1

    def _survival(self, request: Request) -> list[float]:
        """The chance that each of the first max_k draft tokens of `request` is accepted."""
        accepted = request.stats.num_accepted_tokens
        overall = self.acceptance.overall()
        own = (accepted + _REQUEST_PRIOR * overall) / (accepted + request.num_rejections + _REQUEST_PRIOR)
        scale, chance, survival = own / overall, 1.0, []
        for rate in self.acceptance.conditional():
            chance *= min(_MAX_ACCEPT, rate * scale)
            survival.append(chance)
        return survival

    def _costs(self) -> Costs:
        total, count = self._overhead_sums
        return Costs(self._verify, self._draft, total / count if count else 0.0, self._one_forward)

    def _rate(self, windows: list[int], survival: list[list[float]], others: int) -> float:
        """Expected tokens per second of a step shape with these windows (all zero: plain decoding)."""
        costs = self._costs()
        count = len(windows)
        if not any(windows):
            return (count + others) / max(1e-9, costs.verify_seconds(count + others) + costs.overhead)
        tokens = count + sum(sum(s[:k]) for s, k in zip(survival, windows))
        verify = costs.verify_seconds(count + sum(windows))
        draft = costs.draft_seconds(windows)
        seconds = max(draft, verify) + costs.overhead if self.overlapped else draft + verify + 2 * costs.overhead
        return tokens / max(1e-9, seconds)

    def _best_k(self, survival: list[list[float]], caps: Sequence[int], others: int) -> tuple[int, float]:
        """The uniform k (capped per request) with the most expected tokens per second, and that rate."""
        rates = [(self._rate([min(k, cap) for cap in caps], survival, others), -k) for k in range(self.max_k + 1)]
        rate, neg_k = max(rates)
        return -neg_k, rate

    def _trim(self, windows: list[int], survival: list[list[float]], rate: float) -> list[int]:
        """Shorten each window while its last token is expected to bring less than its cost at `rate`
        (dropping a token worth s that costs c seconds raises tokens/second exactly when s < rate x c)."""
        costs = self._costs()
        draft_per_token = costs.draft.weights()[1]
        verify_per_token = costs.verify.weights()[1]
        if self.overlapped:  # the slower part is what an extra token lengthens
            slower_is_draft = costs.draft_seconds(windows) >= costs.verify_seconds(len(windows) + sum(windows))
            per_token = draft_per_token if slower_is_draft else verify_per_token
        else:
            per_token = draft_per_token + verify_per_token
        trimmed = []
        for window, chances in zip(windows, survival):
            while window and chances[window - 1] < rate * per_token:
                window -= 1
            trimmed.append(window)
        return trimmed
