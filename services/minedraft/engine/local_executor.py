"""The in-process executor: drafter and verifier in one process, their stages on two threads."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from minedraft.config import EngineConfig
from minedraft.engine.adaptive.threads import StepThreads
from minedraft.engine.eagle_drafter import EagleDraftWorker
from minedraft.engine.plans import DraftPlan, StepResult, VerifyPlan
from minedraft.engine.runners import build_drafter, max_model_len, target_runner
from minedraft.engine.step import DraftSide, LocalEnds, QueuedChanges, StepPlan, VerifySide, merge_loaded, ordered
from minedraft.engine.workers import DraftWorker, VerifyWorker
from minedraft.model.runner import ModelRunner


class LocalExecutor(QueuedChanges):
    """Runs a step's two sides (engine/step.py) in this process: the draft and verify parts concurrently on two
    threads (torch releases the GIL in its kernels), then the step-end exchange by handing objects over directly.
    A step with one part, or whose draft part follows its verification, runs its parts on the caller's thread,
    one after the other.

    `stage_threads`: intra-op threads of each stage when both run at once. On a CPU the two stages share
    the cores; giving each all of them makes their thread pools fight (spinning OpenMP workers), so the
    engine gives each half. A part that runs alone on the caller's thread takes the count measured fastest
    here for its kind of step (`StepThreads`): beside a busy neighbour process, a forward on every core waits
    at each parallel region for the thread that shares its core with the neighbour.
    """

    def __init__(
        self,
        verifier: VerifyWorker,
        drafter: DraftWorker | None = None,
        stage_threads: int | None = None,
        max_in_flight: int = 1,
    ) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.max_in_flight = max_in_flight
        self._verifying = VerifySide(verifier, features=isinstance(drafter, EagleDraftWorker))
        self._drafting = DraftSide(drafter) if drafter is not None else None
        super().__init__()
        self._submitted: deque[StepPlan] = deque()
        # Without a drafter nothing overlaps: verify on the caller's thread.
        self._verify_thread = _stage_thread("verifier", stage_threads) if drafter else None
        self._draft_thread = _stage_thread("drafter", stage_threads) if drafter else None
        # The stages split one CPU's cores when they run at once (a part that only prefills then runs in turn).
        self.shares_cores = stage_threads is not None
        self.threads = StepThreads(verifier.device.type, beside=0)

    @property
    def kv_pool(self) -> tuple[int, int]:
        cache = self.verifier.runner.kv_cache
        return cache.num_blocks, cache.block_size

    @property
    def draft_kv_blocks(self) -> int | None:
        return self.drafter.kv_blocks if self.drafter is not None else None

    def submit(self, draft: DraftPlan | None, verify: VerifyPlan | None) -> None:
        """Queue a step with the admissions and releases made since the last one; it runs when collected,
        in order (one caller thread does both). With `max_in_flight` 2 the engine plans a step before the
        previous one has run, as it does over the services' streams: the same schedules, in one process."""
        self._submitted.append(self.take_changes(ordered(draft, verify, self.shares_cores), verify))

    def collect(self) -> StepResult:
        return self.run(self._submitted.popleft())

    def step(self, draft: DraftPlan | None, verify: VerifyPlan | None) -> StepResult:
        self.submit(draft, verify)
        return self.collect()

    def flush(self) -> StepResult:
        """Apply the admissions, releases and adapter changes made since the last step (the engine is idle)."""
        self.threads.rest()
        return self.run(self.take_changes(None, None))

    def run(self, plan: StepPlan) -> StepResult:
        """One step: both sides' changes (the verifier's first: its refusal of an adapter wins), then the parts,
        beside each other on the stage threads or one after the other here, then the windows to the verifier."""
        if plan.draft is not None and self._drafting is None:
            raise RuntimeError("a draft plan was given but this executor has no drafter")
        ends = LocalEnds(drafting=self._drafting is not None)
        self._verifying.end = ends
        result = self._verifying.prepare(plan)
        if self._drafting is not None:
            self._drafting.end = ends
            drafter = self._drafting.prepare(plan)
            merge_loaded(result.lora_loaded, drafter.lora_loaded)
            result.prefix_cache_queries.update(drafter.prefix_cache_queries)
            result.prefix_cache_hits.update(drafter.prefix_cache_hits)
        start = time.perf_counter()
        alone = self._threads_alone(plan)
        if plan.draft is not None and plan.verify is not None and not plan.in_turn:
            # Both stages at once, each on its own thread with its share of the cores.
            drafting = self._draft_thread.submit(self._drafting.run, plan, result)
            self._verify_thread.submit(self._verify, plan, result, ends).result()
            drafting.result()
        else:  # one stage alone, or one after the other, here with every core
            self._verify(plan, result, ends)
            if self._drafting is not None:
                self._drafting.run(plan, result)
        self._verifying.receive(plan)
        if alone:
            self.threads.done(time.perf_counter() - start)
            result.thread_trial = self.threads.trying
        result.draft_after_verify = plan.in_turn
        result.step_seconds = time.perf_counter() - start
        return result

    def _verify(self, plan: StepPlan, result: StepResult, ends: LocalEnds) -> None:
        """The verifier's part; a failure reaches the drafter's side waiting for its results."""
        try:
            self._verifying.verify(plan, result)
        except BaseException as exc:
            ends.fail(exc)
            raise

    def _threads_alone(self, plan: StepPlan) -> bool:
        """Set the caller's threads for a step whose parts run here one at a time (not on the stage threads);
        whether it does. Drafting, verifying windows and plain decoding cost differently at one size: each is
        a kind of its own, sized by its requests and the tokens it feeds (prompts included: the admissions are
        applied by now)."""
        draft, verify = plan.draft, plan.verify
        part = verify or draft
        if part is None or draft is not None and verify is not None and not plan.in_turn:
            return False
        verifier = self.verifier
        prompts = verifier.prompt_tokens(verify) if verify is not None else 0
        if plan.in_turn:
            kind, tokens = "verify+draft", verifier.held_tokens(verify) + prompts + draft.num_tokens
        elif verify is None:
            kind, tokens = "draft", draft.num_tokens
        else:
            held = verifier.held_tokens(verify)
            kind, tokens = "verify" if held > len(verify.tasks) else "plain", held + prompts
        self.threads.use(together=False, requests=len(part.tasks), prefill=bool(part.prefill) or prompts > 0,
                         part=kind, tokens=tokens)
        return True

    def close(self) -> None:
        for thread in (self._verify_thread, self._draft_thread):
            if thread is not None:
                thread.shutdown(wait=True)


def _stage_thread(name: str, threads: int | None) -> ThreadPoolExecutor:
    """One long-lived thread per stage (torch's intra-op thread count is a per-thread setting)."""
    init = (lambda: torch.set_num_threads(threads)) if threads else None
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=init)


def build_local_executor(
    config: EngineConfig, num_slots: int, max_in_flight: int = 1
) -> tuple[LocalExecutor, ModelRunner]:
    """Load the target (and the draft, when speculating) into this process."""
    if config.tensor_parallel_size != 1:
        raise ValueError("the in-process executor runs the target on one device (tensor_parallel_size=1)")
    device = config.resolved_device()
    target = target_runner(config, num_slots, device)
    drafter = build_drafter(config, num_slots, max_model_len(config), device, target.config) if (
        config.speculative_config) else None  # fmt: skip
    # A drafter without a model takes no cores from the verifier.
    overlapped = drafter is not None and device == "cpu" and not config.drafts_without_model
    stage_threads = max(1, torch.get_num_threads() // 2) if overlapped else None
    verifier = VerifyWorker(target, prediction_window=0 if drafter else config.prediction_draft_tokens)
    return LocalExecutor(verifier, drafter, stage_threads, max_in_flight), target
