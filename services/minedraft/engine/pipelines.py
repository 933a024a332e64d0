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
from dataclasses import replace

from minedraft.config import EngineConfig, Mode, SpeculativeConfig
from minedraft.engine.adaptive import SpeculationController
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
    # Whether drafting runs beside verification, so that a step costs its slower part (adaptive k's model).
    overlapped = False

    def __init__(self, config: EngineConfig) -> None:
        self.spec: SpeculativeConfig | None = config.speculative_config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.batches = BatchManager(self.num_batches, config.max_num_seqs)
        self.drafted: set[str] = set()  # the requests the last planned step drafted: the verifier holds their windows
        spec = self.spec
        self.controller = (
            SpeculationController(spec.num_speculative_tokens, overlapped=self.overlapped,
                                  one_forward_drafts=spec.parallel_drafting)
            if spec is not None and spec.adaptive else None
        )  # fmt: skip

    @property
    def lookahead(self) -> int:
        """Tokens a request can put in the KV cache past its window in one step: the most drafts + 1."""
        return (self.spec.max_draft_len if self.spec else 0) + 1

    def schedule(self) -> Schedule:
        """Admit requests and plan the next step: (admitted, draft plan, verify plan)."""
        admitted, draft, verify = self._schedule()
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
            left -= end - start
            request.num_prefilled = None if end == last else end
        new_draft = None
        if self.spec is not None and (draft_tasks or chunks):
            new_draft = replace(draft, tasks=draft_tasks, prefill=chunks) if draft else DraftPlan([], prefill=chunks)
        return new_draft, VerifyPlan(verify_tasks, prefill=chunks) if verify_tasks or chunks else None

    def _draft_plan(self, requests: list[Request], continuing: frozenset[str] = frozenset(),
                    others: int = 0) -> DraftPlan | None:
        """Draft k tokens per request (k + e and a capacity when Tetris is on for this batch size); with
        adaptive speculation each request's k is the controller's (`others`: requests of the other batch).

        Requests in `continuing` draft on after the window the verifier holds for them (PEARL).
        """
        if not requests or self.spec is None:
            return None
        spec = self.spec
        tetris = spec.tetris and len(requests) >= spec.tetris_turn_on_batch_size
        k = spec.max_draft_len if tetris else spec.num_speculative_tokens
        # Drafts past the request's last token are wasted: each verification adds one token of its own.
        carried = [(r.pending_drafts or 0) if r.request_id in continuing else 0 for r in requests]
        caps = [max(0, min(k, r.remaining_tokens - c - 1)) for r, c in zip(requests, carried)]
        if self.controller is not None and not tetris:
            caps = self.controller.choose(requests, caps, others)
        tasks = [DraftTask(r.request_id, n, r.request_id in continuing) for r, n in zip(requests, caps)]
        capacity = (spec.tetris_capacity or spec.num_speculative_tokens * self.max_num_seqs) if tetris else None
        return DraftPlan(tasks, tetris_capacity=capacity)


class AutoregressivePipeline(Pipeline):
    """Target only: every step verifies the whole batch with no drafts, one token each."""

    def _schedule(self) -> Schedule:
        admitted = self.batches.admit_into(0)
        batch = self.batches.batches[0]
        return admitted, None, VerifyPlan([VerifyTask(r.request_id) for r in batch]) if batch else None


class TwoBatchPipeline(Pipeline):
    """MineDraft: draft batch X while batch Y is verified, then swap roles.

    With one batch (standard SD) the same schedule alternates draft-only and verify-only steps; when
    one of MineDraft's batches is empty it degrades to exactly that.
    """

    num_batches = 2
    overlapped = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._step = 0

    def _schedule(self) -> Schedule:
        x = self._step % 2
        if self.num_batches == 1 and x == 1:  # SD's verify half-step
            self._step += 1
            return [], None, self._verify_drafted(self.batches.batches[0])
        # Requests join the smaller batch, the one drafted next on a tie. (Always "the one drafted next" would
        # let the batches drift apart when steps are planned ahead: a request that ends in the step in flight
        # is replaced while the *other* batch is planned, and synchronised streams would pile into one batch.)
        admitted = self.batches.admit_balanced(prefer=x) if self.num_batches == 2 else self.batches.admit_into(x)
        to_draft = self.batches.batches[x]
        to_verify = self.batches.batches[1 - x] if self.num_batches == 2 else []
        draft = self._draft_plan(to_draft, others=len(to_verify))
        if self.controller is not None and draft is not None and not any(t.num_tokens for t in draft.tasks):
            # Speculation does not pay now: one plain step over every running request (the windows held for
            # the other batch are verified with it), and the same batch is drafted next time.
            return admitted, None, VerifyPlan([VerifyTask(r.request_id) for r in to_draft + to_verify])
        self._step += 1
        return admitted, draft, self._verify_drafted(to_verify)

    def _verify_drafted(self, batch: list[Request]) -> VerifyPlan | None:
        """Verify the requests of `batch` that the previous step drafted (planned, not yet necessarily run:
        the step protocol keeps the workers' order, so their windows are there when this step runs)."""
        ready = [VerifyTask(r.request_id) for r in batch if r.request_id in self.drafted]
        return VerifyPlan(ready) if ready else None


class SequentialPipeline(TwoBatchPipeline):
    """Standard speculative decoding: draft the batch, then verify it."""

    num_batches = 1
    overlapped = False


class PearlPipeline(Pipeline):
    """Batched PEARL: while a batch's windows are verified, draft their continuations; keep a
    continuation where its window was accepted in full, redraft from the correction elsewhere.

    It plans from the drafts that survived the last step (`pending_drafts`), so it waits for each step's
    results before planning the next."""

    plans_ahead = False
    overlapped = True

    def _schedule(self) -> Schedule:
        admitted = self.batches.admit_into(0)
        batch = self.batches.batches[0]
        verifying = [r for r in batch if r.pending_drafts is not None]
        draft = self._draft_plan(batch, continuing=frozenset(r.request_id for r in verifying))
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
