"""The four decoding modes as step schedules over one executor.

Each `schedule()` admits waiting requests, then returns what to draft and what to verify in the next
step. Two-batch schedules verify what they drafted the step before (`drafted`), so they can plan a step
while the previous one still runs; PEARL plans from `pending_drafts`, the number of draft tokens the
verifier holds for a request after the last step (None: none).
A prompt longer than the step's token budget is prefilled in chunks first (both workers, the same
chunks in the same step); until then it sits in its batch but is neither drafted nor verified.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import replace

from minedraft.config import EngineConfig, Mode, SpeculativeConfig
from minedraft.engine.adaptive import Candidates, Decision, Shape, SpeculationController, StepChoice, seeded_sampling
from minedraft.engine.batch_manager import BatchManager
from minedraft.engine.plans import DraftPlan, DraftTask, PrefillTask, VerifyPlan, VerifyTask
from minedraft.engine.request import Request

Schedule = tuple[list[Request], DraftPlan | None, VerifyPlan | None]
_MIN_CHUNK = 16  # prefill tokens per step however busy decoding is, so a long prompt always advances


class Pipeline(ABC):
    num_batches = 1
    # Whether the next step can be planned before the last one's results are applied (see
    # `LLMEngine.submit_step`): true where a schedule needs only what it planned itself.
    plans_ahead = True
    # The speculative step shapes the mode allows, its own (the fixed one) first (adaptive/).
    shapes: tuple[Shape, ...] = ()

    def __init__(self, config: EngineConfig) -> None:
        self.spec: SpeculativeConfig | None = config.speculative_config
        # Without speculation the verifier drafts from requests' predictions itself (VerifyWorker.prediction_window).
        self._prediction_window = config.prediction_draft_tokens if config.max_prediction_tokens else 0
        self.max_num_seqs = config.max_num_seqs
        self.max_k = config.max_k
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.batches = BatchManager(self.num_batches, config.max_num_seqs)
        self.drafted: set[str] = set()  # the requests the last planned step drafted: the verifier holds their windows
        self.steps_by_shape: Counter[Shape] = Counter()  # planned steps, for `describe`
        self.step_shape = Shape.PLAIN  # the shape of the step being planned
        self.planned = StepChoice()  # how the step planned last was chosen (it travels with the step)
        self._decided: tuple[int, ...] | None = None  # the windows the controller chose for the step being planned
        spec = self.spec
        self.controller = (
            SpeculationController(self.max_k, self.shapes, one_forward_drafts=spec.parallel_drafting)
            if spec is not None and spec.adaptive and self.shapes else None
        )  # fmt: skip

    @property
    def lookahead(self) -> int:
        """Tokens a request can put in the KV cache past its window in one step: the most drafts + 1."""
        return (self.spec.max_window if self.spec else 0) + 1

    @property
    def prediction_lookahead(self) -> int:
        """Without speculation, the tokens more a request with a prediction can write in one step: the window the
        verifier drafts from it (VerifyWorker.prediction_window)."""
        return 0 if self.spec else self._prediction_window

    def schedule(self) -> Schedule:
        """Admit requests and plan the next step: (admitted, draft plan, verify plan); how it was chosen goes
        to `planned`."""
        self._decided = None
        admitted, draft, verify = self._schedule()
        self.planned = StepChoice(self.step_shape, self._decided)
        if draft is not None or verify is not None:
            self.steps_by_shape[self.step_shape] += 1
        for request in admitted:
            request.num_prefilled = 0 if len(request.token_ids) > self.max_num_batched_tokens else None
        draft, verify = self._chunk_prefills(draft, verify)
        self.drafted = {t.request_id for t in draft.tasks} if draft else set()
        self._note_written(verify)
        return admitted, draft, verify

    def _note_written(self, verify: VerifyPlan | None) -> None:
        """Tell admission which tokens the verifier holds after this step (see BatchManager.note_written)."""
        if verify is None:
            return
        running = {r.request_id: r for batch in self.batches.batches for r in batch}
        for task in verify.tasks:
            self.batches.note_written(running[task.request_id], len(running[task.request_id].token_ids))
        for chunk in verify.prefill:
            self.batches.note_written(running[chunk.request_id], chunk.num_tokens)

    @abstractmethod
    def _schedule(self) -> Schedule:
        """The mode's own schedule, before chunked prefill takes out what is still prefilling."""

    def _chunk_prefills(self, draft: DraftPlan | None,
                        verify: VerifyPlan | None) -> tuple[DraftPlan | None, VerifyPlan | None]:
        """Plan the next chunk of every prefilling request within the step's token budget (what the
        verification leaves), oldest first; they take no part in drafting or verifying yet."""
        running = {r.request_id: r for batch in self.batches.batches for r in batch}
        prefilling = sorted((r for r in running.values() if r.num_prefilled is not None), key=lambda r: r.arrival_time)
        if not prefilling:
            return draft, verify
        ids = {r.request_id for r in prefilling}
        draft_tasks = [t for t in draft.tasks if t.request_id not in ids] if draft else []
        verify_tasks = [t for t in verify.tasks if t.request_id not in ids] if verify else []
        decode_tokens = sum((running[t.request_id].pending_drafts or 0) + 1 for t in verify_tasks)
        left = max(_MIN_CHUNK, self.max_num_batched_tokens - decode_tokens)
        chunks = []
        for request in prefilling:
            if left <= 0:
                break
            start, last = request.num_prefilled or 0, len(request.token_ids) - 1  # the last token folds into decoding
            end = min(last, start + left)
            chunks.append(PrefillTask(request.request_id, end))
            if self.spec is not None:  # both workers read the chunk
                request.drafter_tokens = end
            left -= end - start
            request.num_prefilled = None if end == last else end
        new_draft = None
        if self.spec is not None and (draft_tasks or chunks):
            new_draft = replace(draft, tasks=draft_tasks, prefill=chunks) if draft else DraftPlan([], prefill=chunks)
        return new_draft, VerifyPlan(verify_tasks, prefill=chunks) if verify_tasks or chunks else None

    def _decide_adaptively(self, candidates: Candidates, everyone: int) -> Decision:
        """The controller's decision for the step being planned, recorded for it (`planned`)."""
        decision = self.controller.decide(candidates, everyone=everyone)
        self._decided = tuple(decision.request_windows(everyone))
        return decision

    def _tetris(self, requests: list[Request]) -> bool:
        return bool(self.spec and self.spec.tetris and len(requests) >= self.spec.tetris_turn_on_batch_size)

    def _caps(self, requests: list[Request], continuing: frozenset[str] = frozenset()) -> list[int]:
        """The most each request may draft: k (k + e with Tetris), less what would run past its last token (each
        verification adds one token of its own, and a PEARL continuation follows the window held for it)."""
        spec = self.spec
        most = 0 if spec is None else spec.max_window if self._tetris(requests) else self.max_k
        carried = [(r.pending_drafts or 0) if r.request_id in continuing else 0 for r in requests]
        return [max(0, min(most, _own_cap(r, most), r.remaining_tokens - c - 1)) for r, c in zip(requests, carried)]

    def _draft_plan(self, requests: list[Request], windows: list[int],
                    continuing: frozenset[str] = frozenset(), after_verify: bool = False) -> DraftPlan:
        """Draft `windows` tokens per request, Tetris choosing what to keep when it is on for this batch size.
        Requests in `continuing` draft on after the window the verifier holds for them (PEARL); `after_verify`:
        the windows follow this step's verification (DraftPlan.after_verify)."""
        tasks = [DraftTask(r.request_id, n, r.request_id in continuing, len(r.prompt_ids) + r.max_new_tokens)
                 for r, n in zip(requests, windows)]  # fmt: skip
        for request, window in zip(requests, windows):
            if window > 0:  # the drafter reads what it has not yet read of the request, then drafts
                request.drafter_tokens = request.num_tokens
        if not self._tetris(requests):
            return DraftPlan(tasks, after_verify=after_verify)
        return DraftPlan(tasks, tetris_capacity=self.spec.resolved_tetris_capacity(self.max_num_seqs),
                         after_verify=after_verify)


def _own_cap(request: Request, most: int) -> int:
    """The most the request itself lets a window hold: its num_speculative_tokens (Tetris windows too), else `most`."""
    own = request.params.num_speculative_tokens
    return most if own is None else own


class AutoregressivePipeline(Pipeline):
    """Target only: every step verifies the whole batch with no drafts, one token each."""

    def _schedule(self) -> Schedule:
        admitted = self.batches.admit_into(0)
        batch = self.batches.batches[0]
        return admitted, None, VerifyPlan([VerifyTask(r.request_id) for r in batch]) if batch else None


class TwoBatchPipeline(Pipeline):
    """MineDraft: draft batch X while batch Y is verified, then swap roles.

    Every step verifies the requests whose windows the verifier holds (drafted the step before: `pending`) and
    drafts some of the others (`fresh`), by the step's shape:
    - overlap: the fresh requests of one batch, beside the verification of the other (MineDraft);
    - sd: every request (one batch): a step verifies the windows pending and then drafts every request's next
      window from its results (one step a window); with none pending it only drafts. Chosen after overlapped
      steps, it verifies the windows held and drafts after them too;
    - plain: nothing is drafted; every running request is decoded, its pending window verified with it.
    Fixed speculation runs the mode's own shape; adaptive speculation chooses each step's (adaptive/). When
    one batch is empty, overlap degrades to one-batch steps on the other.
    """

    num_batches = 2
    shapes = (Shape.OVERLAP, Shape.SPECULATE)

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._x = 0  # the batch drafted next in the overlapped shape
        self._shape = self.shapes[0]  # the last step's

    def _schedule(self) -> Schedule:
        # Requests join the smaller batch, the one drafted next on a tie. (Always "the one drafted next" would
        # let the batches drift apart when steps are planned ahead: a request that ends in the step in flight
        # is replaced while the *other* batch is planned, and synchronised streams would pile into one batch.)
        admitted = self.batches.admit_balanced(prefer=self._x) if self.num_batches == 2 else self.batches.admit_into(0)
        everyone = [r for batch in self.batches.batches for r in batch]
        pending = [r for r in everyone if r.request_id in self.drafted]
        fresh = [r for r in everyone if r.request_id not in self.drafted]
        if not everyone:
            return admitted, None, None
        # With every window pending, a step may still draft after verifying them (one-batch speculation), where
        # the controller may choose it or it is the mode's own shape; else it only verifies (fixed MineDraft).
        may_draft_after = bool(pending) and (self.controller is not None or self.shapes[0] is Shape.SPECULATE)
        shape, windows, drafting = self._decide(fresh, everyone) if fresh or may_draft_after else (self._shape, [], [])
        self._shape = self.step_shape = shape
        if shape is Shape.PLAIN:
            return admitted, None, VerifyPlan([VerifyTask(r.request_id) for r in everyone])
        if not drafting:
            return admitted, None, self._verify(pending)
        if shape is Shape.OVERLAP and drafting[0].batch == self._x:
            self._x = 1 - self._x
        verifying = pending + self._decoded_first(shape, fresh, drafting)
        # A request this step verifies drafts its next window after the verification, from its results.
        ids = {r.request_id for r in verifying}
        after = any(r.request_id in ids for r in drafting)
        return admitted, self._draft_plan(drafting, windows, after_verify=after), self._verify(verifying)

    def _decoded_first(self, shape: Shape, fresh: list[Request], drafting: list[Request]) -> list[Request]:
        """Adaptive speculation: the fresh requests (no window held) that this step decodes one token each as
        well. One batch: those it drafts, then drafts after their token; overlap: the other batch's, beside the
        drafting. So a step that turns to speculation after plain steps, or that starts a request, makes tokens:
        before, it only drafted, and at 32 requests the drafter's catch-up made a 30-60 ms step of no tokens. Never
        a seeded request (its text depends on where its windows fall) and never with fixed speculation, whose
        rhythm is kept as it was."""
        if self.controller is None:
            return []
        if shape is Shape.SPECULATE:
            held = {r.request_id for r in fresh}
            return [r for r in drafting if r.request_id in held and not seeded_sampling(r)]
        drafted = {r.request_id for r in drafting}
        return [r for r in fresh if r.request_id not in drafted and not seeded_sampling(r)]

    def _decide(self, fresh: list[Request], everyone: list[Request]) -> tuple[Shape, list[int], list[Request]]:
        """The step's shape, the requests it drafts and their windows. One-batch speculation is weighed as its
        rhythm runs it, every request drafted at once: after overlapped steps only one batch is fresh, and the
        step predicted for that half alone looked a third dearer per token than the rhythm's steps measured,
        which kept the default on overlapped steps that made 0.8x of it. (Chosen while windows are pending, it
        verifies them first and drafts after them.) With every window pending, overlap starts the same way: one
        batch drafts after this step's verification, beside which the other drafts the step after."""
        candidates = {Shape.OVERLAP: self._overlap_batch(fresh or everyone), Shape.SPECULATE: everyone}
        own = candidates[Shape.OVERLAP]
        if self.controller is None or self._tetris(candidates[self.shapes[0]]):  # Tetris: its fixed shape, k + e
            shape = self.shapes[0]
            requests = candidates[shape]
            windows = self._caps(requests)
        else:
            # Overlap hides drafting behind the other batch's verification: with that batch empty it would run
            # one part at a time, as a one-batch step does, so it is not a choice then.
            others = len(everyone) > len(own)
            shapes = [s for s in self.shapes if s is not Shape.OVERLAP or others or len(self.shapes) == 1]
            decision = self._decide_adaptively({s: (candidates[s], self._caps(candidates[s])) for s in shapes},
                                               len(everyone))  # fmt: skip
            shape, windows = decision.shape, decision.windows
            requests = candidates.get(shape, [])
        return (shape, windows, requests) if any(windows) else (Shape.PLAIN, [], [])

    def _overlap_batch(self, fresh: list[Request]) -> list[Request]:
        """The fresh requests an overlapped step drafts: those of the batch whose turn it is, or of the other batch
        where nobody in this one may draft (requests capped at 0 would otherwise make every step plain)."""
        mine = [r for r in fresh if r.batch == self._x]
        others = [r for r in fresh if r.batch != self._x]
        if not any(self._caps(mine)) and any(self._caps(others)):
            return others
        return mine or fresh

    @staticmethod
    def _verify(pending: list[Request]) -> VerifyPlan | None:
        """Verify the windows the previous step drafted (planned, not yet necessarily run: the step protocol
        keeps the workers' order, so their windows are there when this step runs)."""
        return VerifyPlan([VerifyTask(r.request_id) for r in pending]) if pending else None


class SequentialPipeline(TwoBatchPipeline):
    """Standard speculative decoding: draft the batch, then verify it."""

    num_batches = 1
    shapes = (Shape.SPECULATE,)


class PearlPipeline(Pipeline):
    """Batched PEARL: while a batch's windows are verified, draft their continuations; keep a
    continuation where its window was accepted in full, redraft from the correction elsewhere.

    It plans from the drafts that survived the last step (`pending_drafts`), so it waits for each step's
    results before planning the next."""

    plans_ahead = False
    shapes = (Shape.OVERLAP,)

    def _schedule(self) -> Schedule:
        admitted = self.batches.admit_into(0)
        batch = self.batches.batches[0]
        verifying = [r for r in batch if r.pending_drafts is not None]
        continuing = frozenset(r.request_id for r in verifying)
        windows = self._caps(batch, continuing)
        if self.controller is not None and not self._tetris(batch):
            decision = self._decide_adaptively({Shape.OVERLAP: (batch, windows)}, len(batch))
            windows = decision.windows or [0] * len(batch)
        self.step_shape = Shape.OVERLAP if any(windows) else Shape.PLAIN
        draft = self._draft_plan(batch, windows, continuing) if batch and self.spec else None
        continued = {t.request_id for t in draft.tasks if t.continue_window and t.num_tokens > 0} if draft else set()
        verify = [VerifyTask(r.request_id, keep_bonus=r.request_id not in continued) for r in verifying]
        return admitted, draft, VerifyPlan(verify) if verify else None


def make_pipeline(config: EngineConfig) -> Pipeline:
    return {
        Mode.AR: AutoregressivePipeline,
        Mode.SD: SequentialPipeline,
        Mode.PEARL: PearlPipeline,
        Mode.MINEDRAFT: TwoBatchPipeline,
    }[config.mode](config)
