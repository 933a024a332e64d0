"""A worker's step, written once: what the in-process executor, the drafter and verifier nodes, the colocated
pair and a pool drafter all run with the plan of a step.

A step's plan (`StepPlan`) carries the changes to make first (releases, LoRA adapter changes, admissions) and the
step's parts. The drafter's side (`DraftSide`) drafts its part and the verifier's (`VerifySide`) verifies its part;
each applies the changes to its worker, sets the intra-op threads of its part and times it, counts its model's
work and its prefix cache's lookups, and performs its half of the step-end exchange through its end of the
channel: the verifier's results to the drafter (and to the other tensor-parallel ranks), then the drafter's windows
to the verifier. What differs between the places a side runs is that end alone:

- in one process (engine/local_executor.py): the objects, handed over directly (`LocalEnds`);
- a drafter and the verifier ranks of one world: tensors over torch.distributed (transport/channel.py);
- a pool drafter and its group's verifier: Exchange calls (pool/link.py).

Each side fills a `StepResult` (the services translate it into their StepReply, wire.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from minedraft.config import EngineConfig
from minedraft.engine.plans import Admission, DraftPlan, Drafts, LoraChange, StepResult, Verified, VerifyPlan

if TYPE_CHECKING:
    import torch

    from minedraft.engine.adaptive.threads import StepThreads
    from minedraft.engine.workers import DraftWorker, VerifyWorker

T = TypeVar("T")
# Per request: the first position and the target's features of the positions its verification committed.
Features = dict[str, tuple[int, "torch.Tensor"]]


@dataclass(frozen=True)
class StepPlan:
    """One step as every worker gets it: the changes to make first, then the parts (either may be absent)."""

    admit: list[Admission] = field(default_factory=list)
    release: list[str] = field(default_factory=list)
    lora: list[LoraChange] = field(default_factory=list)  # before the admissions, after the releases
    draft: DraftPlan | None = None
    verify: VerifyPlan | None = None

    @property
    def in_turn(self) -> bool:
        """Whether the draft part runs after the verify part, from its results (DraftPlan.after_verify)."""
        return self.draft is not None and self.verify is not None and self.draft.after_verify


class QueuedChanges:
    """An executor's admissions, releases and adapter changes since its last step: the next step's plan carries
    them (the engine's calls between steps cost no round trip)."""

    def __init__(self) -> None:
        self.clear_changes()

    def admit(self, seqs: list[Admission]) -> None:
        self._admit.extend(seqs)

    def release(self, request_ids: list[str]) -> None:
        self._release.extend(request_ids)

    def change_loras(self, changes: list[LoraChange]) -> None:
        self._lora_changes.extend(changes)

    def clear_changes(self) -> None:
        self._admit: list[Admission] = []
        self._release: list[str] = []
        self._lora_changes: list[LoraChange] = []

    @property
    def has_changes(self) -> bool:
        return bool(self._admit or self._release or self._lora_changes)

    def take_changes(self, draft: DraftPlan | None, verify: VerifyPlan | None) -> StepPlan:
        """The next step's plan: the changes queued since the last one, then its parts."""
        plan = StepPlan(self._admit, self._release, self._lora_changes, draft, verify)
        self.clear_changes()
        return plan


def ordered(draft: DraftPlan | None, verify: VerifyPlan | None, shares_cores: bool) -> DraftPlan | None:
    """The draft part as the executor sends it. Where the drafter shares one CPU's cores with the verifier (one
    process runs both), a draft part beside a verification that only prefills prompts runs after it, with every
    core (on half the cores the target's share of a prompt step took up to twice as long, while the draft model's
    share was soon done). The executor marks it in the plan, so it knows how the parts ran without being told."""
    if draft is None or verify is None or draft.after_verify or draft.tasks or not shares_cores:
        return draft
    return replace(draft, after_verify=True)


class MissedResults(Generic[T]):
    """The results of the steps the drafter sat out, held until the next step it drafts in.

    A step that drafts nothing (a plain step, a one-batch step's verification half) needs nothing of the
    drafter, so the drafter does not wait there for the step's results: verifier rank 0 keeps them and sends them
    in one message at the start of the next step that drafts, which the drafter applies before drafting. Both ends
    keep the same list from the same plans (the verifier the results, the drafter the request ids it will get),
    and a released request leaves both lists in the same plan, so one admitted again under its id never gets
    tokens of its past. (An EAGLE head reads the target's features of every position: its drafter keeps taking
    part in every step, `defers_results`.)"""

    def __init__(self, request_id: Callable[[T], str]) -> None:
        self._request_id = request_id
        self._items: list[T] = []

    def add(self, items: Iterable[T]) -> None:
        self._items.extend(items)

    def drop(self, request_ids: Iterable[str]) -> None:
        gone = set(request_ids)
        if gone and self._items:
            self._items = [item for item in self._items if self._request_id(item) not in gone]

    def take(self) -> list[T]:
        items, self._items = self._items, []
        return items


def defers_results(config: EngineConfig) -> bool:
    """Whether a drafter in its own process sits out the steps that draft nothing (MissedResults)."""
    return not config.uses_eagle_head


def merge_loaded(into: dict[str, str], loaded: dict[str, str], who: str = "") -> None:
    """Each load's outcome over several workers: "" where all hold the adapter, else the first refusal (prefixed
    with `who` refused it)."""
    for name, error in loaded.items():
        into[name] = into.get(name) or (f"{who}{error}" if error else "")


class DrafterEnd(Protocol):
    """The drafter's end of the step-end exchange."""

    def recv_results(self, request_ids: list[str]) -> list[Verified]:
        """The results of these requests, in their order (this step's, or those of the steps it sat out)."""

    def recv_features(self, request_ids: list[str]) -> Features:
        """The target's features of this step's committed positions (an EAGLE head reads them)."""

    def send_drafts(self, request_ids: list[str], windows: dict[str, Drafts]) -> None:
        """The new windows of the plan's draft tasks; a request absent from `windows` had its window dropped."""


class VerifierEnd(Protocol):
    """A verifier rank's end of the step-end exchange. `leader`: rank 0, which samples (the other ranks take its
    results); `drafting`: a drafter takes part in this world."""

    leader: bool
    drafting: bool

    def send_missed(self, results: list[Verified]) -> None:
        """Rank 0: the results of the steps the drafter sat out, before it drafts."""

    def share_results(self, results: list[Verified] | None, request_ids: list[str],
                      to_drafter: bool) -> list[Verified]:  # fmt: skip
        """Rank 0: hand its results on (to the drafter unless `to_drafter` is False) and return them; the other
        ranks: return rank 0's."""

    def send_features(self, request_ids: list[str], features: Features, width: int) -> None:
        """Rank 0: the target's features of the committed positions, for an EAGLE head."""

    def recv_drafts(self, request_ids: list[str]) -> dict[str, Drafts]:
        """The drafter's new windows for these requests (dropped ones absent)."""


def _prepare(worker: DraftWorker | VerifyWorker, plan: StepPlan, role: str) -> StepResult:
    """Releases, then adapter changes (no request left uses an adapter unloaded), then admissions, whose prefix
    cache lookups the step reports."""
    worker.release(plan.release)
    result = StepResult(lora_loaded=worker.change_loras(plan.lora))
    worker.admit(plan.admit)
    result.record_prefix_cache(role, worker.take_prefix_stats())
    return result


class DraftSide:
    """The drafter's side of a step: its changes, its draft part, then the results in and the windows out.

    `threads`: the intra-op threads it sets for its part (None: its caller sets them); `defers`: it sits out the
    steps that draft nothing (MissedResults); `lock`: held around the worker's calls, never while waiting for the
    other end (a pool drafter's model, which its groups' steps share); `owns`: the requests of this side's group,
    where the worker holds several groups'."""

    def __init__(self, worker: DraftWorker, end: DrafterEnd | None = None, threads: StepThreads | None = None,
                 defers: bool = False, lock: Any = None, owns: Callable[[str], bool] | None = None) -> None:
        from minedraft.engine.eagle_drafter import EagleDraftWorker

        self.worker, self.end, self.threads, self.defers = worker, end, threads, defers
        self.missed: MissedResults[str] = MissedResults(lambda request_id: request_id)  # the verifier holds them
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._owns = owns
        self._reads_features = isinstance(worker, EagleDraftWorker)

    def step(self, plan: StepPlan) -> StepResult:
        result = self.prepare(plan)
        self.run(plan, result)
        return result

    def prepare(self, plan: StepPlan) -> StepResult:
        with self._lock:
            result = _prepare(self.worker, plan, "drafter")
        self.missed.drop(plan.release)
        return result

    def run(self, plan: StepPlan, result: StepResult) -> None:
        """Draft, then the step-end exchange: results in first, then the still-valid windows out (a plan that
        drafts after the verification takes the results first). A step that drafts nothing is left at once where
        the side defers: its results come with the next step that drafts."""
        draft, verify = plan.draft, plan.verify
        if draft is not None:
            missed = self.missed.take()
            if missed:
                self._take_results(missed)
            if plan.in_turn:  # one-batch speculation: the windows follow this step's verification
                self._take_results([t.request_id for t in verify.tasks], verify.request_ids())
            self._draft(draft, verify is not None and not plan.in_turn, result)
        if verify is not None and draft is None and self.defers:
            self.missed.add(t.request_id for t in verify.tasks)
        elif verify is not None and not plan.in_turn:
            self._take_results([t.request_id for t in verify.tasks], verify.request_ids())
        if draft is not None:
            with self._lock:
                windows = self.worker.take_drafts(owns=self._owns)
            self.end.send_drafts([t.request_id for t in draft.tasks], windows)
            result.drafted = {request_id: len(window.tokens) for request_id, window in windows.items()}

    def _take_results(self, request_ids: list[str], written: list[str] | None = None) -> None:
        """These requests' verified tokens (and an EAGLE head's features of the positions `written`), waited for
        outside the lock, then applied."""
        results = self.end.recv_results(request_ids)
        features = self.end.recv_features(written) if written is not None and self._reads_features else None
        with self._lock:
            self.worker.apply_results(results)
            if features is not None:
                self.worker.receive_features(features)

    def _draft(self, draft: DraftPlan, together: bool, result: StepResult) -> None:
        """The draft part, timed on its threads (`together`: beside the verification)."""
        if self.threads is not None:
            self.threads.use(together=together, requests=len(draft.tasks), prefill=bool(draft.prefill),
                             tokens=draft.num_tokens)  # fmt: skip
        start = time.perf_counter()
        with self._lock:
            self.worker.draft(draft)
            work = self.worker.take_work()
        result.draft_seconds = time.perf_counter() - start
        if self.threads is not None:
            self.threads.done(result.draft_seconds)
            result.thread_trial = self.threads.trying
        result.draft_forwards, result.fed_to_draft = work


class VerifySide:
    """A verifier rank's side of a step: its changes, the verify part, its results out, the drafter's windows in.

    `threads`: the intra-op threads it sets for its part (None: its caller sets them); `defers`: the drafter sits
    out the steps that draft nothing (rank 0 keeps their results, MissedResults); `features`: the drafter reads
    the target's features (an EAGLE head)."""

    def __init__(self, worker: VerifyWorker, end: VerifierEnd | None = None, threads: StepThreads | None = None,
                 defers: bool = False, features: bool = False) -> None:  # fmt: skip
        self.worker, self.end, self.threads = worker, end, threads
        self.defers, self.features = defers, features
        self.missed: MissedResults[Verified] = MissedResults(lambda verified: verified.request_id)

    def step(self, plan: StepPlan) -> StepResult:
        result = self.prepare(plan)
        self.verify(plan, result)
        self.receive(plan)
        return result

    def prepare(self, plan: StepPlan) -> StepResult:
        result = _prepare(self.worker, plan, "verifier")
        self.missed.drop(plan.release)
        return result

    def verify(self, plan: StepPlan, result: StepResult) -> None:
        """Rank 0 first sends the drafter the results it missed; then the verify part, its results handed on
        (every rank commits rank 0's) and committed."""
        end, draft, verify = self.end, plan.draft, plan.verify
        sits_out = end.drafting and draft is None and self.defers  # the drafter gets this step's results later
        if draft is not None and end.drafting and end.leader:
            missed = self.missed.take()
            if missed:  # the drafter applies them before it drafts, while this rank verifies
                end.send_missed(missed)
        if verify is None:
            return
        batch, results = self._forward(plan, result)
        if end.leader and sits_out:
            self.missed.add(results)
        results = end.share_results(results, [t.request_id for t in verify.tasks], to_drafter=not sits_out)
        if end.leader and end.drafting and self.features:  # what the EAGLE head reads
            end.send_features(verify.request_ids(), self.worker.features(batch, results),
                              self.worker.runner.feature_width)  # fmt: skip
        self.worker.commit(batch, results)
        result.verified = results

    def _forward(self, plan: StepPlan, result: StepResult) -> tuple[Any, list[Verified] | None]:
        """The target's forward over the plan (and rank 0's sampling), timed on its threads."""
        verify = plan.verify
        if self.threads is not None:
            beside = plan.draft is not None and self.end.drafting and not plan.in_turn  # the drafter computes too
            prompts = self.worker.prompt_tokens(verify)
            self.threads.use(together=beside, requests=len(verify.tasks), prefill=bool(verify.prefill) or prompts > 0,
                             tokens=self.worker.held_tokens(verify) + prompts)  # fmt: skip
        start = time.perf_counter()
        batch = self.worker.forward(verify)
        results = self.worker.sample(batch) if self.end.leader else None
        result.verify_seconds = time.perf_counter() - start
        if self.threads is not None:
            self.threads.done(result.verify_seconds)
            result.thread_trial = self.threads.trying
        result.fed_to_target = self.worker.take_work()[1]
        return batch, results

    def receive(self, plan: StepPlan) -> None:
        """The drafter's new windows, held for the next verification."""
        if plan.draft is not None and self.end.drafting:
            self.worker.receive_drafts(self.end.recv_drafts([t.request_id for t in plan.draft.tasks]))


class LocalEnds:
    """Both ends of one step's exchange in one process: the objects handed over as they are. The two sides may run
    on two threads: a receive waits for its send, or fails with the other side's failure (`fail`)."""

    leader = True

    def __init__(self, drafting: bool) -> None:
        self.drafting = drafting
        self._boxes: dict[str, Future] = {name: Future() for name in ("results", "features", "drafts")}

    def fail(self, exc: BaseException) -> None:
        for box in self._boxes.values():
            if not box.done():
                box.set_exception(exc)

    def send_missed(self, results: list[Verified]) -> None:
        self._boxes["results"].set_result(results)

    def share_results(self, results: list[Verified] | None, request_ids: list[str],
                      to_drafter: bool) -> list[Verified]:  # fmt: skip
        if self.drafting and to_drafter:
            self._boxes["results"].set_result(results)
        return results

    def send_features(self, request_ids: list[str], features: Features, width: int) -> None:
        self._boxes["features"].set_result(features)

    def recv_results(self, request_ids: list[str]) -> list[Verified]:
        return self._boxes["results"].result()

    def recv_features(self, request_ids: list[str]) -> Features:
        return self._boxes["features"].result()

    def send_drafts(self, request_ids: list[str], windows: dict[str, Drafts]) -> None:
        self._boxes["drafts"].set_result(windows)

    def recv_drafts(self, request_ids: list[str]) -> dict[str, Drafts]:
        return self._boxes["drafts"].result()
