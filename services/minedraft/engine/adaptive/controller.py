"""The controller: each step's shape and each drafted request's k, from the acceptance and cost models and from
what each shape's steps measured here (see the package docstring and docs/engine.md, "Adaptive speculation: step
shapes and k")."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from minedraft.engine.adaptive.acceptance import Acceptance
from minedraft.engine.adaptive.costs import Costs, LoadModel, best_k, catch_up_per_token, trim
from minedraft.engine.adaptive.fits import Decayed
from minedraft.engine.adaptive.shapes import Candidates, Decision, Shape, as_it_is, load_kind, seeded_sampling
from minedraft.engine.adaptive.trials import Trials
from minedraft.engine.plans import StepResult

# DEBUG: each decision (what the model predicted, the measured factors) and each step (its parts, its wall time),
# so that an operator can follow why the engine runs the shapes it does (`--log-level DEBUG`).
log = logging.getLogger("minedraft.engine.adaptive")

_RUN = 4  # decisions a shape runs for when tried or probed; docs/engine.md#tuning-constants
_PROBE_EVERY = 128  # decisions of a load from a probe of another shape to the next; docs/engine.md#tuning-constants
_SETTLE = 2  # first steps of a run of a shape (they carry the change), not counted; docs/engine.md#tuning-constants
_FIRST_RUNS = 3  # runs each shape is tried in, interleaved, before one is settled on; docs/engine.md#tuning-constants
_SHAPE_DECAY = 0.9  # per step, of a shape's measured factor: probes outweigh old steps; docs/engine.md#tuning-constants
_RESOLVE_EVERY = 4  # steps learned from before the cost model is solved again; docs/engine.md#tuning-constants
_HOLD = 8  # steps of the same requests a decision drafting nothing may serve; docs/engine.md#tuning-constants


class SpeculationController:
    """Chooses each step's shape and each drafted request's k (see the package docstring).

    `shapes`: the speculative shapes the mode allows, its own (fixed) shape first; PLAIN is always allowed."""

    def __init__(self, max_k: int, shapes: Sequence[Shape], one_forward_drafts: bool,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.max_k = max_k
        self.shapes = tuple(shapes)
        self.acceptance = Acceptance(max_k)
        # The cost model per load (running requests, by powers of four, as the shape factors): a load keeps what
        # it measured while the engine runs at another.
        self._models: dict[int, LoadModel] = {}
        self._one_forward = one_forward_drafts
        self._clock = clock
        self._last_end: float | None = None
        # The load whose model `_costs` solved last, the steps observed then, and what it solved.
        self._solved: tuple[int, int, Costs] | None = None
        self._observed = 0
        # Per load: each shape's wall seconds over predicted seconds; the load of the last decision; the shape of
        # the last step observed and how many steps in a row had it.
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
        self._reading = Decayed()  # the drafter's reads beyond windows: seconds over tokens read
        # Over the controller's life, for `describe` and the tests: windows chosen (k -> request windows),
        # decisions by shape, and decisions that drafted nothing (plain decoding).
        self.windows: Counter[int] = Counter()
        self.chosen: Counter[Shape] = Counter()
        self.num_plain = 0

    @property
    def num_decisions(self) -> int:
        return sum(self.chosen.values())

    @property
    def last_k(self) -> list[int]:
        return self.last.windows if self.last else []

    def observe(self, result: StepResult, shape: Shape) -> None:
        """Learn from one step's results (a step of `shape`): acceptance per position, what its parts and the
        step beyond them cost, and how the shape's wall time at this load compares with the model's. Only
        decoding parts teach the fits (`_learn_parts`); the drafter's cost beyond its windows is charged in the
        settled steps of a speculative run; a part that ran on a thread count being tried measures the count, not
        the shape, and does not count towards the shape's factor."""
        self._observed += 1
        self._learn_acceptance(result)
        together = result.draft_seconds > 0 and result.verify_seconds > 0 and not result.draft_after_verify
        decoding_verify, decoding_draft = self._learn_parts(result, together)
        last_shape, length = self._run
        if shape is not Shape.PLAIN and shape is last_shape and length >= _SETTLE:  # a settled step of its run
            self._charge_drafter(result, together, decoding_draft)
        if result.draft_seconds > 0 and not decoding_draft and self._model.trusted("draft", together):
            self._learn_reading(result, together)
        between = self._learn_overhead(result, shape, together)
        if between is None:
            return
        decoding = (not result.verify_seconds or decoding_verify) and (not result.draft_seconds or decoding_draft)
        counts = decoding and self._model.warm(shape) and not result.thread_trial
        self._measure(shape, result, between, counts, together)

    def _learn_acceptance(self, result: StepResult) -> None:
        """Each verified window, per position; forgetting once per step that verified drafts (plain steps teach
        nothing about acceptance, and forgetting through them wore the estimate back to its prior)."""
        drafted = [v for v in result.verified if v.num_draft_tokens]
        if drafted:
            self.acceptance.decay()
        for verified in drafted:
            self.acceptance.record(verified.num_draft_tokens, verified.num_accepted)

    def _learn_parts(self, result: StepResult, together: bool) -> tuple[bool, bool]:
        """Teach the fits the step's decoding parts, and say which parts were decoding: a part that prefilled a
        prompt (more tokens than the most a decoding request feeds, 2 x (max_k + 1), per request) costs what
        attention over a whole prompt costs, not what the next window will."""
        most_fed = 2 * (self.max_k + 1)
        decoding_verify = 0 < result.fed_to_target <= most_fed * len(result.verified)
        if decoding_verify and result.verify_seconds > 0:
            x = (1.0, len(result.verified), result.fed_to_target)
            plain = not any(v.num_draft_tokens for v in result.verified)
            self._model.learn("verify", together, x, result.verify_seconds, plain=plain)
        decoding_draft = 0 < result.fed_to_draft <= most_fed * len(result.drafted)
        if result.draft_forwards and decoding_draft and result.draft_seconds > 0:
            x = (1.0, result.draft_forwards, result.fed_to_draft)
            self._model.learn("draft", together, x, result.draft_seconds)
        return decoding_verify, decoding_draft

    def _learn_overhead(self, result: StepResult, shape: Shape, together: bool) -> float | None:
        """The step's wall time (from the last result to this one, at most 4 x the step's own seconds, so that
        time the engine sat idle does not count) and, signed, what it took beyond its parts, learned as the
        shape's overhead; None for the first step after idling or one without parts."""
        now, last = self._clock(), self._last_end
        self._last_end = now
        slower = max(result.draft_seconds, result.verify_seconds)
        if last is None or slower <= 0:
            return None
        parts = result.draft_seconds + result.verify_seconds if not together else slower
        between = min(now - last, 4 * max(result.step_seconds, parts))
        self._model.learn_overhead(shape, between, parts)
        _log_step(result, shape, between)
        return between

    def _charge_drafter(self, result: StepResult, together: bool, decoding: bool) -> None:
        """Speculation's cost beyond its windows, in the settled steps of its runs: what a draft part that fed
        more than windows (the prompts of requests that arrived) took beyond drafting its windows, against the
        tokens those steps make. Left out of the fits and the shape factors, since it is not what a window costs;
        a run's first steps are left out here too (the drafter's catch-up there is a cost of turning to
        speculation once, priced by `_catch_up_per_token`)."""
        extra = 0.0
        if result.draft_seconds > 0 and not decoding and self._model.trusted("draft", together):
            part = self._costs().part(together)
            windows = list(result.drafted.values()) or [0]
            extra = max(0.0, result.draft_seconds - part.draft_seconds(windows, self._one_forward))
        self._model.drafter_extra.add(extra, sum(len(v.token_ids) for v in result.verified))

    def _learn_reading(self, result: StepResult, together: bool) -> None:
        """What the drafter takes per token it reads beyond its windows (prompts, catch-ups), from draft parts that
        fed more than windows do: their seconds beyond the windows' prediction over the tokens beyond them (not
        the draft fit's cost per token, which windows teach as forwards and tokens rise together)."""
        windows = list(result.drafted.values())
        read = result.fed_to_draft - sum(windows) - sum(1 for w in windows if w)
        if read <= 0:
            return
        part = self._costs().part(together)
        self._reading.add(max(0.0, result.draft_seconds - part.draft_seconds(windows, self._one_forward)), read)

    def _drafter_extra_per_token(self) -> float:
        return self._model.drafter_extra.per()

    def idle(self) -> None:
        """The engine ran out of work: the time until its next step is waiting for requests, not the overhead of
        that step."""
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
            predicted = self._costs().predicted_seconds(result, shape, together)
            self._trials.add(self._load, shape, seconds, predicted)

    @property
    def _model(self) -> LoadModel:
        """The cost model of the load of the last decision."""
        model = self._models.get(self._load)
        if model is None:
            model = self._models[self._load] = LoadModel()
        return model

    @property
    def warmed_up(self) -> bool:
        return self._model.warm(self.shapes[0])

    def decide(self, candidates: Candidates, everyone: int) -> Decision:
        """The next step's shape and windows. `candidates`: for each speculative shape possible now, the requests
        it would draft and each one's cap; `everyone`: the requests a plain step would decode.

        The shape is the one with the fewest seconds per token: the model's prediction for this moment's requests
        (their acceptance, each shape's best k and trimmed windows) times what the shape's steps measured at this
        load against what the model predicted for them (`Trials`). Until a shape's costs are warm it runs as it
        is (those that run alone first). A request that samples with a seed keeps the mode's own shape and its cap.
        Where nobody would draft even at the global acceptance, a decision that drafts nothing stands for _HOLD
        steps of the same requests, unless a try or probe is due."""
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
                if not self._model.warm(s)]  # fmt: skip
        if cold:  # until the fits have data: each shape as it is
            decision, self.last_catch_up = as_it_is(cold[0], candidates), {}
        else:
            decision = self._weigh(candidates, shapes, allowed, everyone)
        if seeded:
            requests, caps = candidates[decision.shape]
            decision = replace(decision, windows=[cap if seeded_sampling(r) else w
                                                  for r, w, cap in zip(requests, decision.windows, caps)])
        # Never with a seeded request: its windows are its caps, whatever the prediction (its text depends on them).
        holds = not cold and not seeded and not any(decision.windows) and self._nobody_drafts_at_the_prior(
            candidates, shapes, allowed, everyone, key, decision.shape)
        self._held = (key, _HOLD - 1, decision) if holds else None
        self._log_decision(decision, everyone)
        return self._record(decision, everyone)

    def _weigh(self, candidates: Candidates, shapes: list[Shape], allowed: list[Shape], everyone: int) -> Decision:
        """Predicted now (this moment's requests and their acceptance) x what the shape costs beyond the model:
        the shape the trials pick by seconds per token, as the model would run it."""
        decisions = self._by_shape(candidates, shapes, everyone)
        self.last_catch_up = self._catch_up_per_token(candidates, shapes)
        per_token = self._per_token(self.last_rates, allowed, self.last_catch_up)
        shape = self._trials.pick(self._load, sorted(allowed, key=per_token.__getitem__), per_token)
        return decisions[shape]

    def _log_decision(self, decision: Decision, everyone: int) -> None:
        if log.isEnabledFor(logging.DEBUG):
            factors = {s.value: round(f, 3) for s, f in self._trials.costs().get(self._load, {}).items()}
            log.debug("decision at %d running: %s, windows %s; predicted tok/s %s; measured over predicted %s; "
                      "drafter beyond windows %.3f ms a token; catch-up ms a token %s", everyone,
                      decision.shape.value, decision.windows, {k: round(v) for k, v in self.last_rates.items()},
                      factors, self._drafter_extra_per_token() * 1e3,
                      {s.value: round(c * 1e3, 4) for s, c in self.last_catch_up.items()})  # fmt: skip

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
        """Per speculative shape, the drafter's catch-up on the requests it would draft, per token they have left
        (`costs.catch_up_per_token`, at what reading a token has cost it here: `_learn_reading`)."""
        return catch_up_per_token(self._reading, candidates, shapes, fed=self.max_k + 1)

    def _by_shape(self, candidates: Candidates, shapes: list[Shape], everyone: int) -> dict[Shape, Decision]:
        """Each of `shapes`' step as the model would run it (its best k, windows trimmed); its and plain
        decoding's predicted tokens per second go to `last_rates`."""
        decisions, rates = self._predict(candidates, shapes, everyone)
        self.last_rates.update(rates)
        return decisions

    def _predict(self, candidates: Candidates, shapes: list[Shape], everyone: int,
                 own_evidence: bool = True) -> tuple[dict[Shape, Decision], dict[str, float]]:
        """`_by_shape`'s steps and rates (`own_evidence` False: each request at the global acceptance). A shape
        whose windows are all trimmed away runs as a plain step (pipelines.py)."""
        costs = self._costs()
        plain_seconds = costs.alone.verify_seconds(everyone, everyone) + costs.overhead[Shape.PLAIN]
        rates = {Shape.PLAIN.value: everyone / max(1e-9, plain_seconds)}
        decisions = {Shape.PLAIN: Decision(Shape.PLAIN, [])}
        for shape in shapes:
            requests, caps = candidates[shape]
            survival = self.acceptance.survival(requests, own_evidence)
            k, rates[shape.value] = best_k(costs, shape, survival, caps, self.max_k)
            decisions[shape] = Decision(shape, trim(costs, shape, [min(k, cap) for cap in caps], survival,
                                                    rates[shape.value]))  # fmt: skip
        return decisions, rates

    def _record(self, decision: Decision, everyone: int) -> Decision:
        """The controller's own tally of its decisions (for `describe` and its tests; the metrics count each step's
        from its `StepChoice`): the last decision, its windows (`Decision.request_windows`), its shape, and whether
        it drafted nothing."""
        self.last = decision
        self.windows.update(decision.request_windows(everyone))
        self.chosen[decision.shape] += 1
        self.num_plain += not any(decision.windows)
        return decision

    def _costs(self) -> Costs:
        """The model of this load, solved again once it has learned from _RESOLVE_EVERY steps."""
        solved = self._solved
        if solved is None or solved[0] != self._load or self._observed - solved[1] >= _RESOLVE_EVERY:
            solved = self._solved = (self._load, self._observed, self._model.solve(self._one_forward))
        return solved[2]

    def describe(self) -> dict:
        """What the controller measured and chose, for operators (GetServerInfo, the debug route)."""
        return _description(self)


def _log_step(result: StepResult, shape: Shape, between: float) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s step: verify %.2f ms (%d requests, %d tokens), draft %.2f ms (%d tokens), wall %.2f ms, "
                  "%d new tokens", shape.value, result.verify_seconds * 1e3, len(result.verified),
                  result.fed_to_target, result.draft_seconds * 1e3, result.fed_to_draft, between * 1e3,
                  sum(len(v.token_ids) for v in result.verified))  # fmt: skip


def _description(controller: SpeculationController) -> dict:
    """`SpeculationController.describe`."""
    costs = controller._costs()
    return {
        "shapes_allowed": [s.value for s in controller.shapes] + [Shape.PLAIN.value],
        "last_shape": controller.last.shape.value if controller.last else None,
        "last_windows": controller.last_k,
        "predicted_tokens_per_second": {k: round(v, 1) for k, v in controller.last_rates.items()},
        "decisions_by_shape": {s.value: n for s, n in controller.chosen.items()},
        "acceptance_by_position": [round(r, 4) for r in controller.acceptance.conditional()],
        "cost_model_seconds": {
            "verify_alone": costs.alone.verify, "draft_alone": costs.alone.draft,
            "verify_together": costs.together.verify, "draft_together": costs.together.draft,
            "overhead_by_shape": {shape.value: seconds for shape, seconds in costs.overhead.items()},
        },
        "cost_terms": {"verify": ["step", "request", "token"], "draft": ["step", "forward", "token"]},
        "slowdown_beside": {part: round(r, 3) for part, r in controller._model.slowdowns(costs.alone).items()},
        # The drafter's seconds beyond drafting windows (prompts, catching up after plain steps) per token
        # speculative steps made, at the load of the last decision: added to speculative shapes' cost.
        "drafter_extra_seconds_per_token": round(controller._drafter_extra_per_token(), 6),
        # Per speculative shape, the drafter's catch-up the last decision charged per token (see
        # _catch_up_per_token): none where the drafter had read every request that shape would draft.
        "catch_up_seconds_per_token": {s.value: round(c, 6) for s, c in controller.last_catch_up.items()},
        # Per load (load_kind: running requests 1, 2-4, 5-16, 17-64, ... for keys 0, 1, 2, 3, ...): each shape's
        # steps' wall time over the model's prediction for the same work.
        "measured_over_predicted": {
            str(load): {shape.value: round(cost, 4) for shape, cost in by_shape.items() if cost < float("inf")}
            for load, by_shape in controller._trials.costs().items()
        },
    }
