"""The in-process executor: drafter and verifier in one process, their stages on two threads."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch

from minedraft.config import EngineConfig
from minedraft.engine.adaptive.threads import StepThreads
from minedraft.engine.eagle_drafter import EagleDraftWorker
from minedraft.engine.lookup_drafter import LookupDraftWorker
from minedraft.engine.plans import Admission, DraftPlan, LoraChange, StepResult, VerifyPlan
from minedraft.engine.workers import DraftWorker, VerifyWorker
from minedraft.model.checkpoint import resolve_checkpoint
from minedraft.model.config import ModelConfig, load_model_config
from minedraft.model.eagle import EAGLE, EAGLE3, default_aux_layers, eagle_head_kind
from minedraft.model.lora import LoraOptions
from minedraft.model.runner import ModelRunner

T = TypeVar("T")


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


class LocalExecutor:
    """Runs the draft and verify parts of a step concurrently on two threads (torch releases the GIL in
    its kernels), then performs the step-end exchange by handing objects over directly. A step with one
    part runs it on the caller's thread.

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
        self._admit: list[Admission] = []
        self._release: list[str] = []
        self._lora_changes: list[LoraChange] = []
        self._submitted: deque[tuple[_Changes, DraftPlan | None, VerifyPlan | None]] = deque()
        # Without a drafter nothing overlaps: verify on the caller's thread.
        self._verify_thread = _stage_thread("verifier", stage_threads) if drafter else None
        self._draft_thread = _stage_thread("drafter", stage_threads) if drafter else None
        self._shares_cores = stage_threads is not None  # the stages split one CPU's cores when they run at once
        self.threads = StepThreads(verifier.device.type, beside=0)

    @property
    def kv_pool(self) -> tuple[int, int]:
        cache = self.verifier.runner.kv_cache
        return cache.num_blocks, cache.block_size

    @property
    def draft_kv_blocks(self) -> int | None:
        return self.drafter.kv_blocks if self.drafter is not None else None

    def admit(self, seqs: list[Admission]) -> None:
        self._admit.extend(seqs)

    def release(self, request_ids: list[str]) -> None:
        self._release.extend(request_ids)

    def submit(self, draft: DraftPlan | None, verify: VerifyPlan | None) -> None:
        """Queue a step with the admissions and releases made since the last one; it runs when collected,
        in order (one caller thread does both). With `max_in_flight` 2 the engine plans a step before the
        previous one has run, as it does over the services' streams: the same schedules, in one process."""
        self._submitted.append((self._take_changes(), draft, verify))

    def change_loras(self, changes: list[LoraChange]) -> None:
        self._lora_changes.extend(changes)

    def collect(self) -> StepResult:
        changes, draft, verify = self._submitted.popleft()
        loaded = self._apply(changes)
        result = self._run(draft, verify)
        result.lora_loaded = loaded
        return result

    def step(self, draft: DraftPlan | None, verify: VerifyPlan | None) -> StepResult:
        self.submit(draft, verify)
        return self.collect()

    def flush(self) -> StepResult:
        """Apply the admissions, releases and adapter changes made since the last step (the engine is idle)."""
        self.threads.rest()
        return StepResult(lora_loaded=self._apply(self._take_changes()))

    def _take_changes(self) -> _Changes:
        changes = _Changes(self._admit, self._release, self._lora_changes)
        self._admit, self._release, self._lora_changes = [], [], []
        return changes

    def _apply(self, changes: _Changes) -> dict[str, str]:
        """Releases, then adapter changes (no request left uses an adapter unloaded), then admissions; returns
        each load's outcome, the first worker's refusal winning."""
        loaded: dict[str, str] = {}
        for worker in (self.verifier, self.drafter):
            if worker is not None:
                worker.release(changes.release)
                for name, error in worker.change_loras(changes.lora).items():
                    loaded[name] = loaded.get(name) or error
                worker.admit(changes.admit)
        return loaded

    def _run(self, draft: DraftPlan | None, verify: VerifyPlan | None) -> StepResult:
        start = time.perf_counter()
        result = StepResult()
        if draft is not None and (self.drafter is None or self._draft_thread is None):
            raise RuntimeError("a draft plan was given but this executor has no drafter")
        run_draft = partial(self.drafter.draft, draft) if self.drafter and draft else None
        run_verify = partial(self.verifier.verify, verify) if verify else None
        result.draft_after_verify = bool(run_draft and run_verify and self.in_turn(draft))
        alone = self._threads_alone(draft, verify, result.draft_after_verify)
        if result.draft_after_verify:  # one stage after the other, here, with every core
            result.verified, result.verify_seconds = _timed(run_verify)
            self._results_to_drafter(result)
            _, result.draft_seconds = _timed(run_draft)
        elif run_draft and run_verify and self._draft_thread and self._verify_thread:
            # Both stages at once, each on its own thread with its share of the cores.
            pending_draft = self._draft_thread.submit(_timed, run_draft)
            result.verified, result.verify_seconds = self._verify_thread.submit(_timed, run_verify).result()
            _, result.draft_seconds = pending_draft.result()
        elif run_draft:  # one stage alone runs here, with every core
            _, result.draft_seconds = _timed(run_draft)
        elif run_verify:
            result.verified, result.verify_seconds = _timed(run_verify)
        if alone:
            self.threads.done(time.perf_counter() - start)
            result.thread_trial = self.threads.trying
        if run_draft:
            result.draft_forwards, result.draft_tokens = self.drafter.take_work()
        if run_verify:
            result.verify_tokens = self.verifier.take_work()[1]
        for role, worker in (("verifier", self.verifier), ("drafter", self.drafter)):
            if worker is not None:
                result.record_prefix_cache(role, worker.take_prefix_stats())
        if self.drafter is not None:  # the synchronisation point: results first, then drafts
            if not result.draft_after_verify:
                self._results_to_drafter(result)
            handed_over = self.drafter.take_drafts()
            self.verifier.receive_drafts(handed_over)
            result.drafted = {request_id: len(d.tokens) for request_id, d in handed_over.items()}
        result.step_seconds = time.perf_counter() - start
        return result

    def _threads_alone(self, draft: DraftPlan | None, verify: VerifyPlan | None, after: bool) -> bool:
        """Set the caller's threads for a step whose parts run here one at a time (not on the stage threads);
        whether it does. Drafting, verifying windows and plain decoding cost differently at one size: each is
        a kind of its own, sized by its requests and the tokens it feeds (prompts included: the admissions are
        applied by now)."""
        part = verify or draft
        if part is None or draft is not None and verify is not None and not after:
            return False
        verifier = self.verifier
        prompts = verifier.prompt_tokens(verify) if verify is not None else 0
        if after:
            kind, tokens = "verify+draft", verifier.held_tokens(verify) + prompts + draft.num_tokens
        elif verify is None:
            kind, tokens = "draft", draft.num_tokens
        else:
            held = verifier.held_tokens(verify)
            kind, tokens = "verify" if held > len(verify.tasks) else "plain", held + prompts
        self.threads.use(together=False, requests=len(part.tasks), prefill=bool(part.prefill) or prompts > 0,
                         part=kind, tokens=tokens)
        return True

    def in_turn(self, draft: DraftPlan) -> bool:
        """Whether a step with this draft part and a verify part runs the verification first and then the draft
        part (with every core), rather than both at once: a window drafted from this step's results, or, on a
        CPU the stages share, a draft part that only prefills prompts (on half the cores the target's share of a
        prompt step took up to twice as long, while the draft model's share was soon done)."""
        return draft.after_verify or not draft.tasks and self._shares_cores

    def _results_to_drafter(self, result: StepResult) -> None:
        """The step's verified tokens (and an EAGLE head's features) to the drafter."""
        if isinstance(self.drafter, EagleDraftWorker):
            self.drafter.receive_features(self.verifier.take_features())
        self.drafter.apply_results(result.verified)

    def close(self) -> None:
        for thread in (self._verify_thread, self._draft_thread):
            if thread is not None:
                thread.shutdown(wait=True)


@dataclass
class _Changes:
    """What a step applies before it runs: admissions, releases and LoRA adapter changes."""

    admit: list[Admission]
    release: list[str]
    lora: list[LoraChange]


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
    dtype = config.resolved_dtype(device)
    max_len = config.max_model_len or load_model_config(config.target_path).max_position_embeddings
    target = ModelRunner(config.target_path, num_slots=num_slots, max_seq_len=max_len, device=device, dtype=dtype,
                         batch_invariant=config.batch_invariant, **target_options(config))
    drafter = build_drafter(config, num_slots, max_len, device, target.config) if config.speculative_config else None
    # A drafter without a model takes no cores from the verifier.
    overlapped = drafter is not None and device == "cpu" and not config.drafts_without_model
    stage_threads = max(1, torch.get_num_threads() // 2) if overlapped else None
    verifier = VerifyWorker(target, prediction_window=0 if drafter else config.prediction_draft_tokens)
    return LocalExecutor(verifier, drafter, stage_threads, max_in_flight), target


def build_drafter(config: EngineConfig, num_slots: int, max_len: int, device: str,
                  target: ModelConfig | None = None) -> DraftWorker:  # fmt: skip
    """The drafter's worker: one that looks its drafts up (method ngram, suffix), or the draft model's (checked
    against the target's vocabulary, where given)."""
    if config.drafts_without_model:
        return LookupDraftWorker(config.speculative_config, max_len, config.draft_support_size)  # type: ignore[arg-type]
    runner = draft_runner(config, num_slots, max_len, device)
    if target is not None:
        check_compatible(target, runner.config)
    return draft_worker(config, runner)


def draft_runner(config: EngineConfig, num_slots: int, max_len: int, device: str) -> ModelRunner:
    """The draft model. Its logits need not be batch-shape invariant (whatever it proposes, the output is
    exactly the target's), so it always uses the fast kernels. An EAGLE head reads the target's
    tokenizer and embedding (an EAGLE-1 head: and LM head), and keeps no prefix cache: it writes each
    position from the target's features, which the verifier hands on for every position, those of a prefix
    it took from its cache included."""
    options = runner_options(config)
    if config.uses_eagle_head:
        check_eagle_head(config)
        options.update(target_path=config.target_path, enable_prefix_caching=False)
    drafter_adapters = {m.name: m.draft_path for m in config.lora_modules if m.draft_path}
    if drafter_adapters or config.allow_runtime_lora_updating and takes_drafter_adapters(config):
        options.update(lora=lora_options(config, drafter_adapters))  # run-time loads may bring drafter adapters
    return ModelRunner(
        config.draft_path,
        num_slots=num_slots,
        max_seq_len=max_len,
        device=device,
        dtype=config.resolved_dtype(device),
        batch_invariant=False,
        **options,
    )


def draft_worker(config: EngineConfig, runner: ModelRunner) -> DraftWorker:
    """The drafter's worker; with parallel_drafting, it drafts with the mask token the checkpoint names."""
    if config.uses_eagle_head:
        parallel = config.speculative_config is not None and config.speculative_config.parallel_drafting
        return EagleDraftWorker(runner, support_size=config.draft_support_size, parallel=parallel)
    mask_token = None
    if config.speculative_config is not None and config.speculative_config.parallel_drafting:
        mask_token = runner.config.pard_token
        if mask_token is None:
            raise ValueError(
                f"parallel_drafting needs a draft model trained for it (PARD): {config.draft_path}/config.json "
                "names no pard_token"
            )
    return DraftWorker(runner, support_size=config.draft_support_size, mask_token=mask_token)


def target_options(config: EngineConfig) -> dict[str, Any]:
    """The target's runner: with an EAGLE drafter it keeps the features the head reads; with LoRA, the
    adapters of lora_modules."""
    options = runner_options(config)
    if config.uses_eagle_head:
        options.update(aux_hidden_layers=eagle_aux_layers(config))
    if config.enable_lora:
        options.update(lora=lora_options(config, {m.name: m.path for m in config.lora_modules}))
    return options


def takes_drafter_adapters(config: EngineConfig) -> bool:
    """Whether the drafter can apply LoRA adapters of its own: a draft model does; EAGLE heads and PARD do not."""
    spec = config.speculative_config
    return (spec is not None and not config.uses_eagle_head and not spec.parallel_drafting
            and not spec.drafts_without_model)  # fmt: skip


def lora_options(config: EngineConfig, adapters: dict[str, str]) -> LoraOptions:
    return LoraOptions(adapters, config.max_loras, config.max_lora_rank, config.max_cpu_loras)


def eagle_aux_layers(config: EngineConfig) -> tuple[int, ...]:
    """The target's hidden states the EAGLE head reads (ModelRunner's aux_hidden_layers): an EAGLE-1 head the
    last one after the final norm; an EAGLE-3 head the inputs of the layers its config names, else the usual
    three."""
    head = check_eagle_head(config)
    target_layers = load_model_config(config.target_path).num_hidden_layers
    if config.speculative_config.method == EAGLE:  # type: ignore[union-attr] (checked above)
        return (target_layers,)
    return head.aux_hidden_layers or default_aux_layers(target_layers)


def check_eagle_head(config: EngineConfig) -> ModelConfig:
    """The head's config, once its folder shows the kind of head the method names (model/eagle.py)."""
    assert config.speculative_config is not None
    head, method = load_model_config(config.draft_path), config.speculative_config.method
    kind = eagle_head_kind(resolve_checkpoint(config.draft_path), head)
    if kind != method:
        name = {EAGLE: "EAGLE-1", EAGLE3: "EAGLE-3"}
        layout = {EAGLE: "LlamaForCausalLM, fc.weight, no model.* weights", EAGLE3: "LlamaForCausalLMEagle3"}
        what = (f"an {name[kind]} head (use method {kind})" if kind else
                f"a {head.architecture} checkpoint without that layout ({layout.get(method, '')})")  # fmt: skip
        raise ValueError(f"method {method} needs an {name.get(method, method)} head: {config.draft_path} is {what}")
    return head


def runner_options(config: EngineConfig) -> dict[str, Any]:
    """The settings every worker's runner shares: how it sizes and keeps its paged KV cache (drafter and
    verifier alike, so the engine can admit by the smaller of the two pools), and how it launches steps."""
    return {
        "enforce_eager": config.enforce_eager,
        "block_size": config.block_size,
        "kv_cache_memory_bytes": config.kv_cache_memory_bytes,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "enable_prefix_caching": config.enable_prefix_caching,
        "tokenizer": config.tokenizer,
    }


def check_compatible(target: ModelConfig, draft: ModelConfig) -> None:
    """Drafts are token ids of the target's vocabulary: the two models must share it."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft.vocab_size} tokens) differs from the target's ({target.vocab_size}): "
            "the draft model must use the target's tokenizer"
        )
