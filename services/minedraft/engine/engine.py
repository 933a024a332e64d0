"""The engine loop: requests in, steps through a pipeline on an executor, tokens out."""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from minedraft.config import EngineConfig, LoraModule, num_slots
from minedraft.engine.adaptive import StepChoice
from minedraft.engine.batch_manager import BlockBudget
from minedraft.engine.detokenizer import Decoder
from minedraft.engine.intake import bad_words_ids, check_request, prediction_ids
from minedraft.engine.loras import LoraAdapters, LoraDone
from minedraft.engine.pipelines import Pipeline, make_pipeline
from minedraft.engine.plans import Admission, Executor, StepResult
from minedraft.engine.request import Request, RequestStatus, SpecDecodeStats
from minedraft.sampling.params import SamplingParams, TokenLogprob


@dataclass
class StepStats:
    """Step counters summed over the engine's life; averages are what benchmarks report."""

    num_steps: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    step_seconds: float = 0.0
    prefix_cache_queries: dict[str, int] = field(default_factory=dict)  # per worker role, prompt tokens
    prefix_cache_hits: dict[str, int] = field(default_factory=dict)

    def add(self, result: StepResult) -> None:
        self.num_steps += 1
        self.draft_seconds += result.draft_seconds
        self.verify_seconds += result.verify_seconds
        self.step_seconds += result.step_seconds
        for role, queries in result.prefix_cache_queries.items():
            self.prefix_cache_queries[role] = self.prefix_cache_queries.get(role, 0) + queries
            self.prefix_cache_hits[role] = self.prefix_cache_hits.get(role, 0) + result.prefix_cache_hits[role]

    def prefix_cache_hit_rate(self, role: str = "verifier") -> float:
        """Share of the prompt tokens admitted to `role` that its prefix cache held."""
        queries = self.prefix_cache_queries.get(role, 0)
        return self.prefix_cache_hits.get(role, 0) / queries if queries else 0.0


class LLMEngine:
    """Owns every request's state and drives the workers one step at a time. Not thread-safe:
    one caller steps it (the offline API, or the scheduler's step loop)."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        tokenizer: Decoder,
        eos_token_ids: list[int],
        max_model_len: int,
    ) -> None:
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.pipeline = make_pipeline(config)
        self.speculating = config.speculative_config is not None
        self.kv_pool: tuple[int, int] | None = None  # the smaller worker's pool, as of the last (re)start
        self._budget_blocks(self.pipeline)
        self.pipeline.batches.max_loras = config.max_loras if config.enable_lora else None
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # unfinished requests kept out of the workers (see engine/quarantine.py)
        self.step_stats = StepStats()
        self.num_preemptions = 0  # requests sent back to the queue for lack of KV blocks, over the engine's life
        self.last_step: StepResult | None = None
        # The steps handed over and not applied, oldest first: their numbers and how they were chosen.
        self._in_flight: deque[tuple[int, StepChoice]] = deque()
        self._num_planned = 0
        self.spec_stats = SpecDecodeStats()
        self._seeds = random.Random(config.seed)
        self._ids = itertools.count()
        self.loras = LoraAdapters(config, executor)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, **options: str | None) -> Request:
        """Validate and queue a request (`options`: make_request's). Raises ValueError with a message on bad
        input."""
        request = self.make_request(prompt_ids, params, **options)
        self.enqueue(request)
        return request

    def make_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        lora: str | None = None,
    ) -> Request:
        """Validate a request without queueing it (so a caller can check a whole batch first); it runs through
        LoRA adapter `lora`, a name in lora_modules."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_ids, params)
        request = Request.create(
            request_id,
            prompt_ids,
            params,
            seed=params.seed if params.seed is not None else self._seeds.getrandbits(63),
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            tokenizer=self.tokenizer,
            prompt=prompt,
        )
        request.bad_words_ids = bad_words_ids(self.tokenizer, params.bad_words)
        request.prediction_ids = prediction_ids(self, params.prediction)
        request.lora = self.loras.check(lora)
        return request

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The bounds that depend on the model (intake.check_request), checked before a request reaches any step;
        any thread may call it."""
        check_request(self, prompt_ids, params)

    @property
    def lora_modules(self) -> dict[str, LoraModule]:
        """The adapters served, run-time loads included."""
        return self.loras.modules

    @property
    def lora_adapters(self) -> list[str]:
        """The adapters a new request may run through: not one still loading, nor one being unloaded."""
        return self.loras.names

    def load_lora(self, module: LoraModule, done: LoraDone) -> None:
        """Load an adapter while serving (allow_runtime_lora_updating; its folders inside lora_root). It goes to
        every worker with the next step; `done(None)` once all of them hold it, `done(refusal)` naming the file
        if one could not (it is unloaded again). Raises LoraRefused for what is refused before the workers."""
        self.loras.load(module, done)

    def unload_lora(self, name: str, done: LoraDone) -> None:
        """Unload an adapter: new requests for it are refused from now on; the running and waiting ones finish
        first, then the workers drop it and `done(None)` is called (see `settle_loras`)."""
        self.loras.unload(name, done, (r.lora for r in self.requests.values()))

    def settle_loras(self) -> None:
        """Finish each unload whose adapter no request (running, waiting or held) uses any more."""
        self.loras.settle(r.lora for r in self.requests.values())

    def flush(self) -> None:
        """Apply pending admissions, releases and adapter changes now (the engine is idle)."""
        self.loras.loaded(self.executor.flush())

    def enqueue(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.pipeline.batches.add(request)

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its KV is freed on both workers at the next step boundary."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return
        if self.held.pop(request_id, None) is not None or self.pipeline.batches.abort_waiting(request_id) is not None:
            del self.requests[request_id]
        else:
            request.abort()

    def hold(self, request_id: str) -> None:
        """Keep a request that has not started out of the workers until `release_held` lets it go."""
        request = self.pipeline.batches.take_waiting(request_id)
        if request is not None:
            self.held[request_id] = request

    def release_held(self, may_run: Callable[[str], bool]) -> None:
        """Queue again, in arrival order, the held requests that may run now."""
        for request in sorted(self.held.values(), key=lambda r: r.arrival_time):
            if may_run(request.request_id):
                del self.held[request.request_id]
                self.pipeline.batches.add(request)

    def running_ids(self) -> list[str]:
        """The requests the workers hold now, in arrival order."""
        running = (r for b in self.pipeline.batches.batches for r in b if not r.finished)
        return [r.request_id for r in sorted(running, key=lambda r: r.arrival_time)]

    def has_unfinished(self) -> bool:
        """Whether a step has work: an unfinished request that is not held."""
        return len(self.requests) > len(self.held)

    def step(self) -> list[Request]:
        """Run one step; return the requests that got new tokens or finished in it."""
        return self.collect_step() if self.submit_step() else []

    def advance(self) -> list[Request] | None:
        """Keep the executor fed: submit steps until `max_in_flight` are out (the next plan then travels while
        a step runs), then apply the oldest one. Returns the requests it touched; None if no step ran."""
        while self.has_unfinished() and self.in_flight < self.max_in_flight and self.submit_step():
            pass
        return self.collect_step() if self.in_flight else None

    @property
    def in_flight(self) -> int:
        """Steps handed to the executor whose results have not been applied yet."""
        return len(self._in_flight)

    @property
    def max_in_flight(self) -> int:
        """Steps that may be in flight at once: 2 where the executor takes a step while one runs (the next
        plan is then on its way while the workers compute) and the mode plans without the last results."""
        return self.executor.max_in_flight if self.pipeline.plans_ahead else 1

    def submit_step(self) -> bool:
        """Plan the next step and hand it to the executor; False if there is nothing to run.

        With a step still in flight (`max_in_flight` 2) this plans from the results applied so far: a request
        that finishes in the step in flight may be planned once more (its tokens are dropped), and the
        workers bound every write by their own KV limits."""
        self._release_finished()
        preempted = self.pipeline.batches.preempt_to_fit()
        if preempted:
            self.num_preemptions += len(preempted)
            self.executor.release([r.request_id for r in preempted])
        admitted, draft, verify = self.pipeline.schedule()
        self._num_planned += 1
        for request in admitted:
            request.admitted_in = self._num_planned
        if admitted:
            self.executor.admit(
                [Admission(r.request_id, r.token_ids, r.params, r.seed, r.batch, r.num_prompt_tokens, r.bad_words_ids,
                           r.lora, r.prediction_ids) for r in admitted]  # fmt: skip
            )
        if draft is None and verify is None:
            return False
        self.executor.submit(draft, verify)
        self._in_flight.append((self._num_planned, self.pipeline.planned))
        return True

    def collect_step(self) -> list[Request]:
        """Apply the oldest step in flight; return the requests that got new tokens or finished in it."""
        step, choice = self._in_flight.popleft()
        result = self.executor.collect()
        result.choice = choice
        self.loras.loaded(result)
        if self.pipeline.controller is not None:
            self.pipeline.controller.observe(result, choice.shape)
        self.step_stats.add(result)
        self.last_step = result
        touched = []
        for verified in result.verified:
            request = self._running_since(verified.request_id, step)
            if request is None:
                continue
            request.pending_drafts = None
            request.record_verification(verified.num_draft_tokens, verified.num_accepted)
            self.spec_stats.record(verified.num_draft_tokens, verified.num_accepted)
            if verified.prompt_logprobs is not None and request.prompt_logprobs == []:
                request.prompt_logprobs = verified.prompt_logprobs
            if not request.finished:  # finished or aborted meanwhile: its tokens are dropped
                self._append(request, verified.token_ids, verified.logprobs)
            touched.append(request)
        for request_id, num_tokens in result.drafted.items():
            request = self._running_since(request_id, step)
            if request is not None:
                request.pending_drafts = num_tokens
        touched.extend(r for r in self._release_finished() if r not in touched)
        if not self.requests and not self._in_flight:
            self.flush()  # idle: free the last requests' KV now, not with a next step
            if self.pipeline.controller is not None:
                self.pipeline.controller.idle()
        return touched

    def _running_since(self, request_id: str, step: int) -> Request | None:
        """The request, if the workers still hold the state that `step` ran on: not if it was preempted, or
        admitted again, after that step was planned (its tokens then come again from its new admission)."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING and not request.finished:
            return None
        return request if request.admitted_in <= step else None

    @staticmethod
    def _append(request: Request, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> None:
        """A failure in one request's own bookkeeping (detokenizing, stop strings) fails that request alone."""
        try:
            request.append_tokens(token_ids, logprobs)
        except Exception as exc:
            request.fail(f"processing its output failed: {type(exc).__name__}: {exc}")

    def restart(self, speculate: bool, may_run: Callable[[str], bool] | None = None) -> None:
        """The workers lost every request (a worker died, a new world was formed): start each unfinished
        request again from its prompt and the tokens it has so far, in arrival order, speculating or (without
        a drafter) target-only. The workers re-prefill them; no token already produced changes. Afterwards
        exactly the requests for which `may_run` is false are held (see `hold`): held ones that may run now
        are queued again."""
        self._in_flight.clear()  # the steps in flight were lost with the old world
        self.loras.send_loading_again()
        batches = self.pipeline.batches
        running = sorted((r for b in batches.batches for r in b), key=lambda r: r.arrival_time)
        for request in [r for r in running if r.finished]:
            del self.requests[request.request_id]
        self.speculating = speculate and self.config.speculative_config is not None
        self.pipeline = make_pipeline(self.config if self.speculating else self.config.target_only())
        self._budget_blocks(self.pipeline)
        held, self.held = list(self.held.values()), {}
        for request in sorted(running + list(batches.waiting) + held, key=lambda r: r.arrival_time):
            if not request.finished:
                request.restart()
                self.pipeline.batches.add(request)
        for request_id in [r for r in self.requests if may_run is not None and not may_run(r)]:
            self.hold(request_id)

    @classmethod
    def local(cls, config: EngineConfig, max_in_flight: int = 1) -> LLMEngine:
        """Drafter and verifier in this process (the offline API and the tests). `max_in_flight` 2 plans
        each step before the previous one has run (see `advance`), as the services do."""
        from minedraft.engine.local_executor import build_local_executor

        executor, runner = build_local_executor(config, num_slots=num_slots(config), max_in_flight=max_in_flight)
        return cls(config, executor, runner.tokenizer, runner.config.eos_token_ids, runner.max_seq_len)

    def _budget_blocks(self, pipeline: Pipeline) -> None:
        """Admission by the workers' KV pool (a step of the pipeline can write `lookahead` tokens more), as the
        executor reports it now: a new world may hold another pool (a worker came back with another budget,
        or the drafter left)."""
        self.kv_pool = pool = self.executor.kv_pool
        if pool is not None:
            num_blocks, block_size = pool
            # Each step in flight can write `lookahead` tokens that the engine has not seen yet.
            lookahead = pipeline.lookahead * self.max_in_flight
            draft_blocks = self.executor.draft_kv_blocks if self.speculating else None
            pipeline.batches.budget = BlockBudget(num_blocks, block_size, lookahead, self.max_model_len,
                                                  draft_blocks, self.config.enable_prefix_caching,
                                                  pipeline.prediction_lookahead * self.max_in_flight)  # fmt: skip
            self.kv_pool = min(num_blocks, draft_blocks or num_blocks), block_size

    def _release_finished(self) -> list[Request]:
        done = self.pipeline.batches.remove_finished()
        if done:
            self.executor.release([r.request_id for r in done])
            for r in done:
                del self.requests[r.request_id]
        return done
