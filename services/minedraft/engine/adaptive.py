"""Adaptive speculation: the shape of each step and how many tokens each request drafts in it, from what was
measured here.

Two online models (docs/engine.md, "Adaptive speculation: step shapes and k"):

- acceptance: the chance that the draft token at position j is accepted when every one before it was,
  from decayed counts over all verifications, scaled per request by its own acceptance so far (shrunk
  towards the global figure while it has few verifications);
- cost, per load (running requests, by powers of four): the seconds of a verify part as a + c x requests + b x
  target tokens, of a draft part as e + c' x draft forwards + d x draft tokens, each fitted twice: for a part that
  ran alone (plain steps, the halves of a one-batch step) and for one that ran beside the other part (overlapped
  steps; on one CPU the two share its cores), and each step's overhead beyond its parts (planning, transport, the
  engine's bookkeeping, and for overlapped steps the wait at their synchronisation point), per shape, from the
  wall time between results; least squares with forgetting over the work the workers report (StepResult), so
  nothing is tuned for one machine.

Each decision takes, of the shapes the mode allows (plain decoding; one batch that drafts, then is verified;
drafting beside verification), the one with the fewest seconds per token: predicted for the requests running now,
with the k in 1..max with the most expected tokens per second and each request's window trimmed where its next
token is expected to be worth less than it costs, times what the shape's steps took at this load against what the
model predicted for them (measured in runs, tried now and then: `Trials`), since a step costs more than its parts
in ways the model does not see; a speculative shape also pays, spread over the tokens its requests have left, the
catch-up the drafter owes them (what it has not read of them) before it can draft. The choice reads only
verifications already made, never the token about to be sampled, so every output stays exactly the target's.
Requests that sample with a seed keep the mode's own shape and the fixed k, so that their text is the same on
every run.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from minedraft.engine.fits import DECAY, OnlineFit, Ratio, Trials
from minedraft.engine.plans import StepResult
from minedraft.engine.request import Request

# DEBUG: each decision (what the model predicted, the measured factors) and each step (its parts, its wall time),
# so that an operator can follow why the engine runs the shapes it does (`--log-level DEBUG`).
log = logging.getLogger(__name__)

_WARMUP_STEPS = 4  # steps of a kind seen before its cost fits are trusted (until then the shape runs as it is)
# The shapes are tried in runs of this many decisions, and one run of another shape every _PROBE_EVERY decisions
# of a load; the first _SETTLE steps of a run of a shape do not count (they carry the change: windows drafted in
# the other shape, the drafter's catch-up). Each shape is first tried in _FIRST_RUNS runs, interleaved: served,
# steps vary by 10-20% with the serving processes on the same cores, and one try of two counted steps decided
# the first hundred decisions. See SpeculationController.decide.
_RUN, _PROBE_EVERY, _SETTLE, _FIRST_RUNS = 4, 128, 2, 3
_SHAPE_DECAY = 0.9  # per step of a shape's measured factor (wall over predicted): a probe's steps outweigh older ones
_REQUEST_PRIOR = 6.0  # verifications' weight of the global acceptance in a request's own estimate
# Per step a request runs without drafts, what its own verifications weigh: a request that turned to plain steps
# learns nothing more of its drafts, and it kept an estimate from its first few verifications to its end.
_REQUEST_FADE = 0.8
_MAX_ACCEPT = 0.995
_RESOLVE_EVERY = 4  # steps learned from before the cost model is solved again (the fits forget 2% a step)
_HOLD = 8  # steps of the same requests that one decision drafting nothing may serve (see SpeculationController.decide)


class Acceptance:
    """Per draft position j: the chance it is accepted when positions 0..j-1 were (decayed counts)."""

    def __init__(self, max_k: int) -> None:
        self.reached = [0.0] * max_k
        self.accepted = [0.0] * max_k
        self.samples = 0  # windows recorded: the estimate changes with each, and with nothing else

    def decay(self) -> None:
        self.reached = [n * DECAY for n in self.reached]
        self.accepted = [n * DECAY for n in self.accepted]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.samples += 1
        for j in range(min(num_accepted + 1, num_drafts, len(self.reached))):
            self.reached[j] += 1
            self.accepted[j] += j < num_accepted

    def conditional(self) -> list[float]:
        """Each position's estimate, leaning on the position before it while it has few counts, and optimistic
        before any: plain steps verify no drafts, so an estimate that started low (or saw a bad first few
        windows) kept drafting off until a probe, for hundreds of steps; one that starts high drafts until the
        windows show that drafting does not pay, which a useless draft shows within a few steps."""
        rates, prior = [], 1.0
        for reached, accepted in zip(self.reached, self.accepted):
            prior = (accepted + 2 * prior) / (reached + 2)
            rates.append(prior)
        return rates

    def overall(self) -> float:
        """Accepted over reached, all positions together."""
        return (sum(self.accepted) + 1) / (sum(self.reached) + 2)



class Shape(str, Enum):
    """How a step runs (docs/engine.md, "Step shapes")."""

    PLAIN = "plain"  # nothing drafted: the target decodes every running request, one token each
    SPECULATE = "sd"  # one batch: every request drafts its window, then the target verifies them all
    OVERLAP = "overlap"  # drafting beside verification: MineDraft's two batches, PEARL's continuation


@dataclass(frozen=True)
class Decision:
    shape: Shape
    windows: list[int]  # draft tokens for each of the shape's candidates (PLAIN: none)


@dataclass(frozen=True)
class PartCosts:
    """The fitted seconds of a step's verify and draft parts, run alone or beside each other."""

    verify: list[float]  # a, c, b: seconds per step, per request, per token
    draft: list[float]  # e, c', d: seconds per draft part, per forward, per token

    def verify_seconds(self, requests: float, tokens: float) -> float:
        a, per_request, per_token = self.verify
        return a + per_request * requests + per_token * tokens

    def scaled(self, verify: float, draft: float) -> PartCosts:
        return PartCosts([w * verify for w in self.verify], [w * draft for w in self.draft])

    def draft_seconds(self, windows: Sequence[int], one_forward: bool) -> float:
        if not any(windows):
            return 0.0
        forwards = 1 if one_forward else max(windows)
        drafting = sum(1 for w in windows if w)  # each also feeds the drafter its pending token(s) first
        per_part, per_forward, per_token = self.draft
        return per_part + per_forward * forwards + per_token * (sum(windows) + drafting)


@dataclass(frozen=True)
class Costs:
    """The cost model as of one decision (the fits solved once)."""

    alone: PartCosts  # a part with the machine to itself (plain steps, SD's halves)
    together: PartCosts  # both parts at once (on one CPU they share its cores)
    overhead: Mapping[Shape, float]  # seconds per step of each shape beyond its parts (an overlapped one's slower part)
    one_forward_drafts: bool  # PARD: a window takes one forward


class _LoadModel:
    """What the steps of one load measured: per part, and whether the other part ran beside it, verify a + c x
    requests + b x tokens (a request costs its attention over its context and its bookkeeping whatever its
    window), draft e + c' x forwards + d x tokens (e: what a draft part costs whatever it drafts, sampling and the
    windows' bookkeeping); a part beside the other = the part alone x a measured slowdown;
    per shape, the decayed sum of its steps' overhead samples and their decayed count (per shape, not per kind
    of step: served, an sd half hands its windows from one process to the other, which a plain step does not);
    the drafter's work beyond drafting windows (prompts, and the tokens decoded by plain steps, which it feeds
    when drafting resumes), decayed seconds against the decayed tokens speculative steps made: speculation's
    own cost per token, which plain decoding never pays (the drafter then sits idle).

    A verify part alone is fitted on two sets of sums solved together: plain steps' and windows', each forgetting
    only as steps of its own kind come, so that a long run of plain steps does not wear away what windows cost
    (the cost of the tokens a window adds is what the choice to draft again is made on)."""

    def __init__(self) -> None:
        self.verify = {False: OnlineFit(3), True: OnlineFit(3)}
        self.verify_plain = OnlineFit(3)
        self.draft = {False: OnlineFit(3), True: OnlineFit(3)}
        self.slowdown = {"verify": Ratio(3), "draft": Ratio(3)}
        self.overhead_sums: dict[Shape, tuple[float, float]] = {}
        self.drafter_extra: tuple[float, float] = (0.0, 0.0)

    def learn(self, part: str, together: bool, x: Sequence[float], seconds: float, plain: bool = False) -> None:
        fits = self.verify if part == "verify" else self.draft
        (self.verify_plain if plain and not together else fits[together]).add(x, seconds)
        if together:
            self.slowdown[part].add(x, seconds)

    def seen(self, part: str, together: bool) -> int:
        if part == "draft":
            return self.draft[together].count
        return self.verify[together].count + (0 if together else self.verify_plain.count)

    def weights(self, part: str, together: bool) -> list[float]:
        if part == "draft":
            return self.draft[together].weights()
        return self.verify[True].weights() if together else self.verify[False].weights(self.verify_plain)


def load_kind(running: int) -> int:
    """The load a decision is made at, for the cost models and the shape factors: running requests 1, 2-4, 5-16,
    17-64, 65-256, ... (factors of four, a few kinds to learn). Each kind ends at a power of two, where a server's
    concurrency usually sits, so a load hovering just below it as requests end and join stays one kind: with edges
    at 8 and 32, a load hovering at 32 (30, 31, 32) switched between two models and two sets of shape factors every
    few steps, each choosing its own shape, and the default turned between shapes for nothing."""
    kind, edge = 0, 1
    while running > edge and kind < 7:
        kind, edge = kind + 1, edge * 4
    return kind


def seeded_sampling(request: Request) -> bool:
    """Whether the request samples with a seed: its text depends on its windows, which therefore stay fixed."""
    return request.params.seed is not None and request.params.temperature > 0


Candidates = Mapping[Shape, tuple[Sequence[Request], Sequence[int]]]


class SpeculationController:
    """Chooses each step's shape and each drafted request's k (see the module docstring).

    `shapes`: the speculative shapes the mode allows, its own (fixed) shape first; PLAIN is always allowed."""

    def __init__(self, max_k: int, shapes: Sequence[Shape], one_forward_drafts: bool,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.max_k = max_k
        self.shapes = tuple(shapes)
        self.acceptance = Acceptance(max_k)
        # The cost model per load (running requests, by powers of four, as the shape factors): a line fits the
        # steps of one load where it does not fit a curve across loads, and a load keeps what it measured while
        # the engine runs at another (one fit for all, after hundreds of steps at one request, extrapolated to
        # 32 from steps that never varied their requests).
        self._models: dict[int, _LoadModel] = {}
        self._one_forward = one_forward_drafts
        self._clock = clock
        self._last_end: float | None = None
        # The load whose model `_costs` solved last, the steps observed then, and what it solved.
        self._solved: tuple[int, int, Costs] | None = None
        self._observed = 0
        # Per load (running requests, by powers of four): each shape's wall seconds over predicted seconds; the load
        # of the last decision; the shape of the last step observed and how many steps in a row had it.
        self._trials = Trials(_RUN, _PROBE_EVERY, _SHAPE_DECAY, first_runs=_FIRST_RUNS)
        self._load = 0
        self._run: tuple[Shape | None, int] = (None, 0)
        # The last decision that drafted nothing where nobody would draft: its requests, the steps it may still
        # serve, the decision (see `decide`).
        self._held: tuple[tuple, int, Decision] | None = None
        self._prior_check: tuple = (None, -1, False)  # the requests, the acceptance's samples, the answer
        self.last: Decision | None = None
        self.last_rates: dict[str, float] = {}  # each option's predicted tokens/second, when it was last predicted
        self.last_catch_up: dict[Shape, float] = {}  # the catch-up charged per token, by shape, when last decided
        self._reading = (0.0, 0.0)  # decayed seconds and tokens of the drafter's reads beyond windows
        # Over the controller's life, for the metrics and the tests: windows chosen (k -> request windows),
        # decisions by shape, decisions, and decisions that drafted nothing (plain decoding).
        self.windows: Counter[int] = Counter()
        self.chosen: Counter[Shape] = Counter()
        self.num_decisions = 0
        self.num_plain = 0

    @property
    def last_k(self) -> list[int]:
        return self.last.windows if self.last else []

    def observe(self, result: StepResult, shape: Shape) -> None:
        """Learn from one step's results (a step of `shape`): acceptance per position, what its parts and the
        step beyond them cost, and how the shape's wall time at this load compares with the model's."""
        self._observed += 1
        drafted = [v for v in result.verified if v.num_draft_tokens]
        if drafted:  # forgetting per step that verified drafts: plain steps teach nothing about acceptance, and
            # decayed through a run of them the estimate fell back to its prior (then 0.5), which kept drafting off
            self.acceptance.decay()
        for verified in drafted:
            self.acceptance.record(verified.num_draft_tokens, verified.num_accepted)
        together = result.draft_seconds > 0 and result.verify_seconds > 0 and not result.draft_after_verify
        # Only decoding steps teach the fits: a step that prefilled a prompt costs what attention over a whole
        # prompt costs, not what the next window will (prompts would pull the per-token cost their way).
        window = 2 * (self.max_k + 1)  # the most tokens a decoding request feeds a model in one step
        decoding_verify = 0 < result.verify_tokens <= window * len(result.verified)
        if decoding_verify and result.verify_seconds > 0:
            x = (1.0, len(result.verified), result.verify_tokens)
            plain = not any(v.num_draft_tokens for v in result.verified)
            self._model.learn("verify", together, x, result.verify_seconds, plain=plain)
        decoding_draft = 0 < result.draft_tokens <= window * len(result.drafted)
        if result.draft_forwards and decoding_draft and result.draft_seconds > 0:
            x = (1.0, result.draft_forwards, result.draft_tokens)
            self._model.learn("draft", together, x, result.draft_seconds)
        last_shape, length = self._run
        if shape is not Shape.PLAIN and shape is last_shape and length >= _SETTLE:  # a settled step of its run
            self._charge_drafter(result, together, decoding_draft)
        if result.draft_seconds > 0 and not decoding_draft and self._trusted("draft", together):
            self._learn_reading(result, together)
        now, last = self._clock(), self._last_end
        self._last_end = now
        slower = max(result.draft_seconds, result.verify_seconds)
        if last is None or slower <= 0:
            return
        # Signed samples (results that arrive together give one short and one long gap; clipping each at 0
        # would bias the mean low), capped so that time the engine sat idle between requests does not count.
        parts = result.draft_seconds + result.verify_seconds if not together else slower
        between = min(now - last, 4 * max(result.step_seconds, parts))
        sums = self._model.overhead_sums
        total, count = sums.get(shape, (0.0, 0.0))
        sums[shape] = (total * DECAY + between - parts, count * DECAY + 1)
        decoding = (not result.verify_seconds or decoding_verify) and (not result.draft_seconds or decoding_draft)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s step: verify %.2f ms (%d requests, %d tokens), draft %.2f ms (%d tokens), wall %.2f ms, "
                      "%d new tokens", shape.value, result.verify_seconds * 1e3, len(result.verified),
                      result.verify_tokens, result.draft_seconds * 1e3, result.draft_tokens, between * 1e3,
                      sum(len(v.token_ids) for v in result.verified))  # fmt: skip
        # A step whose part ran on a thread count being tried (engine/threads.py) measures the count, not the
        # shape: a run of seven plain steps 30% slower than the steps around them (a try's length; the log did not
        # name the count) once sent a served default at 8 requests to one-batch steps for a hundred decisions.
        self._measure(shape, result, between, decoding and self._warm(shape) and not result.thread_trial, together)

    def _charge_drafter(self, result: StepResult, together: bool, decoding: bool) -> None:
        """Speculation's cost beyond its windows, in the settled steps of its runs: a draft part that fed the
        prompts of requests that arrived took longer than drafting its windows would have; the difference,
        against the tokens those steps make. Left out of the fits and the shape factors (it is not what a window
        costs), it made one-batch steps look 20% cheaper than they served at 8 requests, where a new request
        arrives every other step and the drafter reads its prompt. A run's first steps are left out here too:
        there the drafter catches up on the tokens the plain steps before decoded, a cost of turning to
        speculation once, not of each token it makes. Charged per token, every probe's catch-up (16 requests'
        prompts and outputs) had made speculation look 0.2 ms a token dearer at 16 in flight served, where it was
        0.002 ms on a server that stayed on it, and the default kept plain steps that made 0.68x of fixed sd."""
        seconds, tokens = self._model.drafter_extra
        extra = 0.0
        if result.draft_seconds > 0 and not decoding and self._trusted("draft", together):
            costs = self._costs()
            part = costs.together if together else costs.alone
            windows = list(result.drafted.values()) or [0]
            extra = max(0.0, result.draft_seconds - part.draft_seconds(windows, self._one_forward))
        made = sum(len(v.token_ids) for v in result.verified)
        self._model.drafter_extra = (seconds * DECAY + extra, tokens * DECAY + made)

    def _learn_reading(self, result: StepResult, together: bool) -> None:
        """What the drafter takes per token it reads beyond its windows (prompts, catch-ups), from draft parts that
        fed more than windows do: their seconds beyond the windows' prediction over the tokens beyond them. Not the
        draft fit's cost per token: fed by windows, where tokens and forwards rise together at one request, it
        came out at a whole forward a token (0.1 ms), where a prompt read in one forward costs a tenth of that."""
        windows = list(result.drafted.values())
        read = result.draft_tokens - sum(windows) - sum(1 for w in windows if w)
        if read <= 0:
            return
        costs = self._costs()
        part = costs.together if together else costs.alone
        extra = max(0.0, result.draft_seconds - part.draft_seconds(windows, self._one_forward))
        seconds, tokens = self._reading
        self._reading = (seconds * DECAY + extra, tokens * DECAY + read)

    def _drafter_extra_per_token(self) -> float:
        seconds, tokens = self._model.drafter_extra
        return seconds / tokens if tokens > 0 else 0.0

    def idle(self) -> None:
        """The engine ran out of work: the time until its next step is waiting for requests, not the overhead of
        that step (counted as overhead, the gap between two benchmark runs made plain steps, rare in a run,
        look several milliseconds dearer than they are)."""
        self._last_end = None

    def _measure(self, shape: Shape, result: StepResult, seconds: float, counts: bool, together: bool) -> None:
        """A step of `shape` took `seconds` of wall time: against what the cost model predicts for the work it
        did, that is what the shape costs beyond the model here. Only the steps of a run of the shape after its
        first _SETTLE count, and only decoding steps of a shape whose costs are known (`counts`): a step that
        prefilled a prompt costs what the prompt costs, whatever the shape (and a shape tried first at a load is
        tried while the requests that make that load arrive)."""
        last, length = self._run
        self._run = (shape, length + 1 if shape is last else 1)
        if self._run[1] > _SETTLE and counts:
            self._trials.add(self._load, shape, seconds, self._predicted_seconds(result, shape, together))

    def _predicted_seconds(self, result: StepResult, shape: Shape, together: bool) -> float:
        """The model's wall time for a step that did the work `result` reports."""
        costs = self._costs()
        part = costs.together if together else costs.alone
        (per_part, per_forward, per_token), draft, verify = part.draft, 0.0, 0.0
        if result.draft_seconds > 0:
            draft = per_part + per_forward * result.draft_forwards + per_token * result.draft_tokens
        if result.verify_seconds > 0:
            verify = part.verify_seconds(len(result.verified), result.verify_tokens)
        return (max(draft, verify) if together else draft + verify) + costs.overhead[shape]

    @property
    def _model(self) -> _LoadModel:
        """The cost model of the load of the last decision."""
        model = self._models.get(self._load)
        if model is None:
            model = self._models[self._load] = _LoadModel()
        return model

    def _trusted(self, part: str, together: bool) -> bool:
        """Whether a part's cost is known well enough: alone, its fit; beside the other, the slowdown over the
        fit alone (or, where the part never runs alone, as in PEARL's drafting, its own fit)."""
        model = self._model
        return model.seen(part, together) >= _WARMUP_STEPS and (
            not together or model.slowdown[part].count >= _WARMUP_STEPS)

    def _alone_known(self, part: str) -> bool:
        return self._model.seen(part, False) >= _WARMUP_STEPS

    def _warm(self, shape: Shape) -> bool:
        """Whether the costs a shape's rate needs have been seen often enough to be trusted."""
        if shape is Shape.PLAIN:  # plain steps themselves: the fit must see windows of 0 to predict them
            return self._trusted("verify", False) and self._model.verify_plain.count >= _WARMUP_STEPS // 2
        together = shape is Shape.OVERLAP
        return self._trusted("verify", together) and self._trusted("draft", together)

    @property
    def warmed_up(self) -> bool:
        return self._warm(self.shapes[0])

    def decide(self, candidates: Candidates, everyone: int) -> Decision:
        """The next step's shape and windows. `candidates`: for each speculative shape possible now, the requests
        it would draft and each one's cap; `everyone`: the requests a plain step would decode.

        The shape is the one with the fewest seconds per token: the model's prediction for this moment's requests
        (their acceptance, each shape's best k and trimmed windows) times what the shape's steps measured at this
        load against what the model predicted for them (`Trials`). The model's prediction of a whole step misses
        what a step costs beyond its parts (processes waiting on each other, the frontends' share of the cores),
        which the measured factor brings in; a shape's seconds per token measured outright would instead carry the
        acceptance of the requests that ran it, which changes from one request to the next. Each shape the moment
        allows is first tried in a few interleaved runs of a few decisions (in the order predicted), and another
        one runs now and then.

        Where nobody would draft even at the global acceptance (a useless draft), a decision that drafts nothing
        stands for _HOLD steps of the same requests, unless a try or probe is due: until a step drafts, plain
        steps move nothing a prediction reads but each request's own estimate, towards that acceptance, and
        predicting every shape at every k for every step cost a plain step at one request 2%."""
        shapes = [s for s in self.shapes if s in candidates]
        key = (everyone, tuple(tuple((r.request_id, r.arrival_time) for r in candidates[s][0]) for s in shapes))
        held = self._held_decision(key)
        if held is not None:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("decision at %d running: %s, held (%d more steps at most)", everyone, held.shape.value,
                          self._held[1] if self._held else 0)  # fmt: skip
            return self._record(held, everyone)
        seeded = any(seeded_sampling(r) for s in shapes for r in candidates[s][0])
        if seeded:  # a seed asks for the same text on every run: the mode's own shape, seeded windows fixed
            shapes = shapes[:1]
        allowed = shapes + ([] if seeded else [Shape.PLAIN])
        self._load = load_kind(everyone)
        cold = [s for s in sorted(allowed, key=(Shape.SPECULATE, Shape.PLAIN, Shape.OVERLAP).index)
                if not self._warm(s)]  # fmt: skip
        if cold:  # until the fits have data: each shape as it is, those that run alone first (a part beside the
            # other is measured against its cost alone)
            decision, self.last_catch_up = self._as_it_is(cold[0], candidates), {}
        else:  # predicted now (this moment's requests and their acceptance) x what the shape costs beyond the model
            decisions = self._by_shape(candidates, shapes, everyone)
            self.last_catch_up = self._catch_up_per_token(candidates, shapes)
            per_token = self._per_token(self.last_rates, allowed, self.last_catch_up)
            shape = self._trials.pick(self._load, sorted(allowed, key=per_token.__getitem__), per_token)
            decision = decisions[shape]
        if seeded:
            requests, caps = candidates[decision.shape]
            decision = replace(decision, windows=[cap if seeded_sampling(r) else w
                                                  for r, w, cap in zip(requests, decision.windows, caps)])
        # Never with a seeded request: its windows are its caps, whatever the prediction (its text depends on them).
        holds = not cold and not seeded and not any(decision.windows) and self._nobody_drafts_at_the_prior(
            candidates, shapes, allowed, everyone, key, decision.shape)
        self._held = (key, _HOLD - 1, decision) if holds else None
        if log.isEnabledFor(logging.DEBUG):
            factors = {s.value: round(f, 3) for s, f in self._trials.costs().get(self._load, {}).items()}
            log.debug("decision at %d running: %s, windows %s; predicted tok/s %s; measured over predicted %s; "
                      "drafter beyond windows %.3f ms a token; catch-up ms a token %s", everyone,
                      decision.shape.value, decision.windows, {k: round(v) for k, v in self.last_rates.items()},
                      factors, self._drafter_extra_per_token() * 1e3,
                      {s.value: round(c * 1e3, 4) for s, c in self.last_catch_up.items()})  # fmt: skip
        return self._record(decision, everyone)

    def _held_decision(self, key: tuple) -> Decision | None:
        """The last decision, if it holds for this step (see `decide`): the same requests, fewer than _HOLD steps
        since it was made, and its shape what the trials would pick without weighing again."""
        held = self._held
        if held is None or held[0] != key or held[1] <= 0 or not self._trials.keep(self._load, held[2].shape):
            return None
        self._held = (key, held[1] - 1, held[2])
        return held[2]

    def _nobody_drafts_at_the_prior(self, candidates: Candidates, shapes: list[Shape], allowed: list[Shape],
                                    everyone: int, key: tuple, chosen: Shape) -> bool:
        """Whether the decision would draft nothing with each request at the global acceptance, where plain steps
        take its own estimate. Asked again only once the requests or the acceptance changed."""
        if self._prior_check[:2] != (key, self.acceptance.samples):
            decisions, rates = self._predict(candidates, shapes, everyone, own_evidence=False)
            per_token = self._per_token(rates, allowed, self._catch_up_per_token(candidates, shapes))
            shape = self._trials.choice(self._load, allowed, chosen, per_token)
            self._prior_check = (key, self.acceptance.samples, not any(decisions[shape].windows))
        return self._prior_check[2]

    def _per_token(self, rates: Mapping[str, float], allowed: list[Shape],
                   catch_up: Mapping[Shape, float]) -> dict[Shape, float]:
        """Each shape's predicted seconds per token, speculative ones with the drafter's work beyond windows and
        the catch-up that turning to the shape now costs (`_catch_up_per_token`)."""
        extra = self._drafter_extra_per_token()
        return {s: 1.0 / max(1e-9, rates[s.value]) + (0.0 if s is Shape.PLAIN else extra + catch_up.get(s, 0.0))
                for s in allowed}  # fmt: skip

    def _catch_up_per_token(self, candidates: Candidates, shapes: list[Shape]) -> dict[Shape, float]:
        """Per speculative shape, what the drafter's catch-up on the requests it would draft costs per token they
        have left: the tokens it has not read of each (beyond the few a window's draft feeds anyway: the last
        verification's), at what reading a token has cost it here (`_learn_reading`; nothing before it has read
        any), once for every token the requests may still make. The steps that pay it are the first of a run,
        which the shapes' measured factors leave out; uncharged, the default turned to speculation and back every
        few steps where the two decoded at one speed, and offline at 32 requests the drafter read the prompts of a
        whole wave (5,900 tokens, 100 ms) in the first step of each turn."""
        seconds, tokens = self._reading
        if seconds <= 0 or tokens <= 0:
            return {}
        per_token, fed, charges = seconds / tokens, self.max_k + 1, {}
        for shape in shapes:
            requests = candidates[shape][0]
            owed = sum(max(0, r.num_tokens - r.drafter_tokens - fed) for r in requests)
            if owed:
                charges[shape] = per_token * owed / max(1, sum(r.remaining_tokens for r in requests))
        return charges

    def _as_it_is(self, shape: Shape, candidates: Candidates) -> Decision:
        """The shape with every request at its cap (k, or less where the request asks or ends sooner)."""
        return Decision(shape, [] if shape is Shape.PLAIN else list(candidates[shape][1]))

    def _by_shape(self, candidates: Candidates, shapes: list[Shape], everyone: int) -> dict[Shape, Decision]:
        """Each of `shapes`' step as the model would run it (its best k, windows trimmed); its and plain
        decoding's predicted tokens per second go to `last_rates`."""
        decisions, rates = self._predict(candidates, shapes, everyone)
        self.last_rates.update(rates)
        return decisions

    def _predict(self, candidates: Candidates, shapes: list[Shape], everyone: int,
                 own_evidence: bool = True) -> tuple[dict[Shape, Decision], dict[str, float]]:
        """`_by_shape`'s steps and rates (`own_evidence` False: each request at the global acceptance)."""
        costs = self._costs()
        plain_seconds = costs.alone.verify_seconds(everyone, everyone) + costs.overhead[Shape.PLAIN]
        rates = {Shape.PLAIN.value: everyone / max(1e-9, plain_seconds)}
        decisions = {Shape.PLAIN: Decision(Shape.PLAIN, [])}
        for shape in shapes:  # a shape whose windows are all trimmed away runs as a plain step (pipelines.py)
            requests, caps = candidates[shape]
            survival = self._survival(requests, own_evidence)
            k, rates[shape.value] = self._best_k(costs, shape, survival, caps)
            decisions[shape] = Decision(shape, self._trim(costs, shape, [min(k, cap) for cap in caps], survival,
                                                          rates[shape.value]))  # fmt: skip
        return decisions, rates

    def _record(self, decision: Decision, everyone: int) -> Decision:
        self.last = decision
        if decision.windows:
            self.windows.update(decision.windows)
        else:  # plain
            self.windows[0] += everyone
        self.chosen[decision.shape] += 1
        self.num_decisions += 1
        self.num_plain += not any(decision.windows)
        return decision

    def _survival(self, requests: Sequence[Request], own_evidence: bool = True) -> list[list[float]]:
        """For each request, the chance that each of its first max_k draft tokens is accepted (`own_evidence`
        False: as if it had verified nothing yet)."""
        overall, rates = self.acceptance.overall(), self.acceptance.conditional()
        survival = []
        for request in requests:
            fade = _REQUEST_FADE**request.plain_steps if own_evidence else 0.0
            accepted, rejections = fade * request.stats.num_accepted_tokens, fade * request.num_rejections
            own = (accepted + _REQUEST_PRIOR * overall) / (accepted + rejections + _REQUEST_PRIOR)
            scale, chance, chances = own / overall, 1.0, []
            for rate in rates:
                chance *= min(_MAX_ACCEPT, rate * scale)
                chances.append(chance)
            survival.append(chances)
        return survival

    def _costs(self) -> Costs:
        """The model of this load, solved again once it has learned from _RESOLVE_EVERY steps: at one request a
        step takes a few milliseconds, and solving the fits for each question asked of them took 6% of them."""
        solved = self._solved
        if solved is None or solved[0] != self._load or self._observed - solved[1] >= _RESOLVE_EVERY:
            solved = self._solved = (self._load, self._observed, self._solve())
        return solved[2]

    def _solve(self) -> Costs:
        model = self._model
        alone = PartCosts(model.weights("verify", False), model.weights("draft", False))
        ratio = self._slowdowns(alone)
        scaled = alone.scaled(ratio["verify"], ratio["draft"])
        # a part beside the other: its cost alone x its slowdown, or its own fit where it never runs alone
        together = PartCosts(scaled.verify if self._alone_known("verify") else model.weights("verify", True),
                             scaled.draft if self._alone_known("draft") else model.weights("draft", True))
        return Costs(alone, together, self._overheads(), self._one_forward)

    def _overheads(self) -> dict[Shape, float]:
        """Each shape's overhead per step; a shape not seen yet borrows from one that was (plain and sd from
        each other, overlap from either)."""
        seen = {shape: max(0.0, total / count) for shape, (total, count) in self._model.overhead_sums.items() if count}
        fallback = seen.get(Shape.SPECULATE, seen.get(Shape.PLAIN, seen.get(Shape.OVERLAP, 0.0)))
        return {shape: seen.get(shape, fallback) for shape in Shape}

    def _slowdowns(self, alone: PartCosts) -> dict[str, float]:
        slowdown = self._model.slowdown
        return {"verify": slowdown["verify"].value(alone.verify), "draft": slowdown["draft"].value(alone.draft)}

    def _rate(self, costs: Costs, shape: Shape, windows: list[int], survival: list[list[float]]) -> float:
        """Expected tokens per second of a speculative step of `shape` with these windows."""
        count = len(windows)
        tokens = count + sum(sum(s[:k]) for s, k in zip(survival, windows))
        if shape is Shape.OVERLAP:  # in steady state the batch verified beside this one looks like it
            part = costs.together
            verify = part.verify_seconds(count, count + sum(windows))
            seconds = max(part.draft_seconds(windows, costs.one_forward_drafts), verify) + costs.overhead[shape]
        else:
            part = costs.alone
            verify = part.verify_seconds(count, count + sum(windows))
            # one step a window: it verifies the last windows, then drafts the next (DraftPlan.after_verify)
            seconds = part.draft_seconds(windows, costs.one_forward_drafts) + verify + costs.overhead[shape]
        return tokens / max(1e-9, seconds)

    def _best_k(self, costs: Costs, shape: Shape, survival: list[list[float]],
                caps: Sequence[int]) -> tuple[int, float]:
        """The uniform k >= 1 (capped per request) with the most expected tokens per second, and that rate."""
        rates = [(self._rate(costs, shape, [min(k, cap) for cap in caps], survival), -k)
                 for k in range(1, self.max_k + 1)]  # fmt: skip
        rate, neg_k = max(rates)
        return -neg_k, rate

    def _trim(self, costs: Costs, shape: Shape, windows: list[int], survival: list[list[float]],
              rate: float) -> list[int]:
        """Shorten each window while its last token is expected to bring less than its cost at `rate`
        (dropping a token worth s that costs c seconds raises tokens/second exactly when s < rate x c)."""
        if shape is Shape.OVERLAP:  # the slower part is what an extra token lengthens
            part = costs.together
            draft = part.draft_seconds(windows, costs.one_forward_drafts)
            slower_is_draft = draft >= part.verify_seconds(len(windows), len(windows) + sum(windows))
            per_token = part.draft[2] if slower_is_draft else part.verify[2]
        else:
            per_token = costs.alone.draft[2] + costs.alone.verify[2]
        trimmed = []
        for window, chances in zip(windows, survival):
            while window and chances[window - 1] < rate * per_token:
                window -= 1
            trimmed.append(window)
        return trimmed

    def describe(self) -> dict:
        """What the controller measured and chose, for operators (GetServerInfo, the debug route)."""
        costs = self._costs()
        return {
            "shapes_allowed": [s.value for s in self.shapes] + [Shape.PLAIN.value],
            "last_shape": self.last.shape.value if self.last else None,
            "last_windows": self.last_k,
            "predicted_tokens_per_second": {k: round(v, 1) for k, v in self.last_rates.items()},
            "decisions_by_shape": {s.value: n for s, n in self.chosen.items()},
            "acceptance_by_position": [round(r, 4) for r in self.acceptance.conditional()],
            "cost_model_seconds": {
                "verify_alone": costs.alone.verify, "draft_alone": costs.alone.draft,
                "verify_together": costs.together.verify, "draft_together": costs.together.draft,
                "overhead_by_shape": {shape.value: seconds for shape, seconds in costs.overhead.items()},
            },
            "cost_terms": {"verify": ["step", "request", "token"], "draft": ["step", "forward", "token"]},
            "slowdown_beside": {part: round(r, 3) for part, r in self._slowdowns(costs.alone).items()},
            # The drafter's seconds beyond drafting windows (prompts, catching up after plain steps) per token
            # speculative steps made, at the load of the last decision: added to speculative shapes' cost.
            "drafter_extra_seconds_per_token": round(self._drafter_extra_per_token(), 6),
            # Per speculative shape, the drafter's catch-up the last decision charged per token (see
            # _catch_up_per_token): none where the drafter had read every request that shape would draft.
            "catch_up_seconds_per_token": {s.value: round(c, 6) for s, c in self.last_catch_up.items()},
            # Per load (load_kind: running requests 1, 2-4, 5-16, 17-64, ... for keys 0, 1, 2, 3, ...): each shape's
            # steps' wall time over the model's prediction for the same work.
            "measured_over_predicted": {
                str(load): {shape.value: round(cost, 4) for shape, cost in by_shape.items() if cost < float("inf")}
                for load, by_shape in self._trials.costs().items()
            },
        }
