"""The cost model, per load: the seconds of a verify part as a + c x requests + b x target tokens, of a draft part
as e + c' x draft forwards + d x draft tokens, each for a part that ran alone and for one that ran beside the other
part; each shape's overhead per step beyond its parts; the drafter's work beyond its windows. From these, a
speculative step's expected tokens per second, its best k and its trimmed windows (docs/engine.md, "Adaptive
speculation: step shapes and k")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from minedraft.engine.adaptive.fits import Decayed, OnlineFit, Ratio
from minedraft.engine.adaptive.shapes import Candidates, Shape
from minedraft.engine.plans import StepResult

WARMUP_STEPS = 4  # steps of a part seen before its fit is trusted; docs/engine.md#tuning-constants


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

    def part(self, together: bool) -> PartCosts:
        return self.together if together else self.alone

    def predicted_seconds(self, result: StepResult, shape: Shape, together: bool) -> float:
        """The model's wall time for a step that did the work `result` reports: its parts, the slower of the two
        where they ran together, plus the shape's overhead."""
        part = self.part(together)
        (per_part, per_forward, per_token), draft, verify = part.draft, 0.0, 0.0
        if result.draft_seconds > 0:
            draft = per_part + per_forward * result.draft_forwards + per_token * result.fed_to_draft
        if result.verify_seconds > 0:
            verify = part.verify_seconds(len(result.verified), result.fed_to_target)
        return (max(draft, verify) if together else draft + verify) + self.overhead[shape]


class LoadModel:
    """What the steps of one load measured: per part, and whether the other part ran beside it, verify a + c x
    requests + b x tokens (a request costs its attention over its context and its bookkeeping whatever its
    window), draft e + c' x forwards + d x tokens (e: what a draft part costs whatever it drafts, sampling and the
    windows' bookkeeping); a part beside the other = the part alone x a measured slowdown;
    per shape, its steps' overhead samples (per shape, not per kind of step: served, an sd half hands its windows
    from one process to the other, which a plain step does not); the drafter's work beyond drafting windows
    (prompts, and the tokens decoded by plain steps, which it feeds when drafting resumes), its seconds against the
    tokens speculative steps made: speculation's own cost per token, which plain decoding never pays.

    A verify part alone is fitted on two sets of sums solved together: plain steps' and windows', each forgetting
    only as steps of its own kind come, so that a long run of plain steps does not wear away what windows cost
    (the cost of the tokens a window adds is what the choice to draft again is made on)."""

    def __init__(self) -> None:
        self.verify = {False: OnlineFit(3), True: OnlineFit(3)}
        self.verify_plain = OnlineFit(3)
        self.draft = {False: OnlineFit(3), True: OnlineFit(3)}
        self.slowdown = {"verify": Ratio(3), "draft": Ratio(3)}
        self.overhead: dict[Shape, Decayed] = {}  # per shape: seconds beyond the parts, over steps
        self.drafter_extra = Decayed()  # seconds beyond windows, over the tokens speculative steps made

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

    def trusted(self, part: str, together: bool) -> bool:
        """Whether a part's cost is known well enough: alone, its fit; beside the other, the slowdown over the
        fit alone (or, where the part never runs alone, as in PEARL's drafting, its own fit)."""
        return self.seen(part, together) >= WARMUP_STEPS and (
            not together or self.slowdown[part].count >= WARMUP_STEPS)

    def alone_known(self, part: str) -> bool:
        return self.seen(part, False) >= WARMUP_STEPS

    def warm(self, shape: Shape) -> bool:
        """Whether the costs a shape's rate needs have been seen often enough to be trusted."""
        if shape is Shape.PLAIN:  # plain steps themselves: the fit must see windows of 0 to predict them
            return self.trusted("verify", False) and self.verify_plain.count >= WARMUP_STEPS // 2
        together = shape is Shape.OVERLAP
        return self.trusted("verify", together) and self.trusted("draft", together)

    def learn_overhead(self, shape: Shape, wall: float, parts: float) -> None:
        """A step of `shape` took `wall` seconds, `parts` of them in its parts: the rest is its overhead (signed)."""
        sums = self.overhead.setdefault(shape, Decayed())
        sums.add(wall)
        sums.seconds -= parts  # after the decayed sum, to the last bit as the sums have always been kept

    def overheads(self) -> dict[Shape, float]:
        """Each shape's overhead per step; a shape not seen yet borrows from one that was (plain and sd from
        each other, overlap from either)."""
        seen = {shape: max(0.0, sums.per()) for shape, sums in self.overhead.items() if sums.count}
        fallback = seen.get(Shape.SPECULATE, seen.get(Shape.PLAIN, seen.get(Shape.OVERLAP, 0.0)))
        return {shape: seen.get(shape, fallback) for shape in Shape}

    def slowdowns(self, alone: PartCosts) -> dict[str, float]:
        slowdown = self.slowdown
        return {"verify": slowdown["verify"].value(alone.verify), "draft": slowdown["draft"].value(alone.draft)}

    def solve(self, one_forward: bool) -> Costs:
        """The fits solved: a part beside the other costs its cost alone x its slowdown, or its own fit where it
        never runs alone."""
        alone = PartCosts(self.weights("verify", False), self.weights("draft", False))
        ratio = self.slowdowns(alone)
        scaled = alone.scaled(ratio["verify"], ratio["draft"])
        together = PartCosts(scaled.verify if self.alone_known("verify") else self.weights("verify", True),
                             scaled.draft if self.alone_known("draft") else self.weights("draft", True))
        return Costs(alone, together, self.overheads(), one_forward)


def rate(costs: Costs, shape: Shape, windows: list[int], survival: list[list[float]]) -> float:
    """Expected tokens per second of a speculative step of `shape` with these windows: an overlapped step takes
    its slower part (in steady state the batch verified beside it looks like it), a one-batch step both parts
    (it verifies the last windows, then drafts the next: DraftPlan.after_verify), each plus the shape's overhead."""
    count = len(windows)
    tokens = count + sum(sum(s[:k]) for s, k in zip(survival, windows))
    part = costs.part(shape is Shape.OVERLAP)
    verify = part.verify_seconds(count, count + sum(windows))
    draft = part.draft_seconds(windows, costs.one_forward_drafts)
    seconds = (max(draft, verify) if shape is Shape.OVERLAP else draft + verify) + costs.overhead[shape]
    return tokens / max(1e-9, seconds)


def best_k(costs: Costs, shape: Shape, survival: list[list[float]], caps: Sequence[int],
           max_k: int) -> tuple[int, float]:
    """The uniform k in 1..max_k (capped per request) with the most expected tokens per second (the larger k on
    a tie), and that rate."""
    rates = [(rate(costs, shape, [min(k, cap) for cap in caps], survival), -k) for k in range(1, max_k + 1)]
    best, neg_k = max(rates)
    return -neg_k, best


def trim(costs: Costs, shape: Shape, windows: list[int], survival: list[list[float]], at: float) -> list[int]:
    """Shorten each window while its last token is expected to bring less than its cost at the rate `at`
    (dropping a token worth s that costs c seconds raises tokens/second exactly when s < rate x c); in an
    overlapped step an extra token costs what it adds to the slower part."""
    if shape is Shape.OVERLAP:
        part = costs.together
        draft = part.draft_seconds(windows, costs.one_forward_drafts)
        slower_is_draft = draft >= part.verify_seconds(len(windows), len(windows) + sum(windows))
        per_token = part.draft[2] if slower_is_draft else part.verify[2]
    else:
        per_token = costs.alone.draft[2] + costs.alone.verify[2]
    trimmed = []
    for window, chances in zip(windows, survival):
        while window and chances[window - 1] < at * per_token:
            window -= 1
        trimmed.append(window)
    return trimmed


def catch_up_per_token(reading: Decayed, candidates: Candidates, shapes: Sequence[Shape],
                       fed: int) -> dict[Shape, float]:
    """Per speculative shape, what the drafter's catch-up on the requests it would draft costs per token they have
    left: the tokens it has not read of each (beyond the `fed` a window's draft feeds anyway: the last
    verification's), at `reading`'s seconds per token read (nothing before it has read any), once for every token
    the requests may still make. The steps that pay it are the first of a run, which the shapes' measured factors
    leave out; uncharged, the choice would turn to speculation and back every few steps where the two decode at
    one speed (docs/engine.md, "Adaptive speculation: step shapes and k")."""
    if reading.seconds <= 0 or reading.count <= 0:
        return {}
    per_token, charges = reading.seconds / reading.count, {}
    for shape in shapes:
        requests = candidates[shape][0]
        owed = sum(max(0, r.num_tokens - r.drafter_tokens - fed) for r in requests)
        if owed:
            charges[shape] = per_token * owed / max(1, sum(r.remaining_tokens for r in requests))
    return charges
