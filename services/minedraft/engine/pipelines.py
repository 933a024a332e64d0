"""The four decoding modes as step schedules over one executor.

Each `schedule()` admits waiting requests, then returns what to draft and what to verify in the next
step. A request's `pending_drafts` is the number of draft tokens the verifier holds for it (None: none yet).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from minedraft.config import EngineConfig, Mode, SpeculativeConfig
from minedraft.engine.batch_manager import BatchManager
from minedraft.engine.plans import DraftPlan, DraftTask, VerifyPlan, VerifyTask
from minedraft.engine.request import Request

Schedule = tuple[list[Request], DraftPlan | None, VerifyPlan | None]


class Pipeline(ABC):
    num_batches = 1

    def __init__(self, config: EngineConfig) -> None:
        self.spec: SpeculativeConfig | None = config.speculative_config
        self.max_num_seqs = config.max_num_seqs
        self.batches = BatchManager(self.num_batches, config.max_num_seqs)

    @abstractmethod
    def schedule(self) -> Schedule:
        """Admit requests and plan the next step: (admitted, draft plan, verify plan)."""

    def _draft_plan(self, requests: list[Request], continuing: frozenset[str] = frozenset()) -> DraftPlan | None:
        """Draft k tokens per request (k + e and a capacity when Tetris is on for this batch size).

        Requests in `continuing` draft on after the window the verifier holds for them (PEARL).
        """
        if not requests or self.spec is None:
            return None
        spec = self.spec
        tetris = spec.tetris and len(requests) >= spec.tetris_turn_on_batch_size
        k = spec.max_draft_len if tetris else spec.num_speculative_tokens
        tasks = []
        for r in requests:
            cont = r.request_id in continuing
            carried = (r.pending_drafts or 0) if cont else 0
            # Drafts past the request's last token are wasted: each verification adds one token of its own.
            tasks.append(DraftTask(r.request_id, max(0, min(k, r.remaining_tokens - carried - 1)), cont))
        capacity = (spec.tetris_capacity or spec.num_speculative_tokens * self.max_num_seqs) if tetris else None
        return DraftPlan(tasks, tetris_capacity=capacity)

    @staticmethod
    def _verify_plan(requests: list[Request], keep_bonus: bool = True) -> VerifyPlan | None:
        ready = [VerifyTask(r.request_id, keep_bonus) for r in requests if r.pending_drafts is not None]
        return VerifyPlan(ready) if ready else None


class AutoregressivePipeline(Pipeline):
    """Target only: every step verifies the whole batch with no drafts, one token each."""

    def schedule(self) -> Schedule:
        admitted = self.batches.admit_into(0)
        batch = self.batches.batches[0]
        return admitted, None, VerifyPlan([VerifyTask(r.request_id) for r in batch]) if batch else None


class TwoBatchPipeline(Pipeline):
    """MineDraft: draft batch X while batch Y is verified, then swap roles.

    With one batch (standard SD) the same schedule alternates draft-only and verify-only steps; when
    one of MineDraft's batches is empty it degrades to exactly that.
    """

    num_batches = 2

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._step = 0

    def schedule(self) -> Schedule:
        x = self._step % 2
        self._step += 1
        if self.num_batches == 1 and x == 1:  # SD's verify half-step
            return [], None, self._verify_plan(self.batches.batches[0])
        # Before decoding starts requests spread over both batches; later they join the one drafted next.
        starting = self.batches.num_running == 0
        admitted = self.batches.admit_balanced() if starting else self.batches.admit_into(x)
        to_draft = self.batches.batches[x]
        to_verify = self.batches.batches[1 - x] if self.num_batches == 2 else []
        return admitted, self._draft_plan(to_draft), self._verify_plan(to_verify)


class SequentialPipeline(TwoBatchPipeline):
    """Standard speculative decoding: draft the batch, then verify it."""

    num_batches = 1


class PearlPipeline(Pipeline):
    """Batched PEARL: while a batch's windows are verified, draft their continuations; keep a
    continuation where its window was accepted in full, redraft from the correction elsewhere."""

    def schedule(self) -> Schedule:
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
