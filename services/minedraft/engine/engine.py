"""The engine loop: requests in, steps through a pipeline on an executor, tokens out."""

from __future__ import annotations

import itertools
import os
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from minedraft.config import EngineConfig, LoraModule, num_slots
from minedraft.engine.adaptive import StepChoice
from minedraft.engine.batch_manager import BlockBudget
from minedraft.engine.detokenizer import Decoder
from minedraft.engine.pipelines import Pipeline, make_pipeline
from minedraft.engine.plans import Admission, Executor, StepResult
from minedraft.engine.request import Request, RequestStatus, SpecDecodeStats
from minedraft.extras import require
from minedraft.sampling.params import SamplingParams, StructuredOutputs, TokenLogprob


def check_structured_outputs(structured: StructuredOutputs) -> None:
    """ValueError when the grammar library is not installed or the schema or regex is malformed."""
    require("xgrammar", "structured output on this server")
    # xgrammar is optional: sampling.grammar is imported only when a request asks for a grammar
    from minedraft.sampling.grammar import check_grammar

    check_grammar(structured)


class LoraRefused(ValueError):
    """A run-time LoRA load or unload the engine refuses: `kind` is off (not enabled), invalid (a bad name, path
    or folder), exists (a name already served) or not_found (a name not served); the message says why."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


LoraDone = Callable[[LoraRefused | None], None]


def rooted(path: str, root: str, name: str) -> str:
    """`path` (absolute, or relative to `root`) as an absolute path, if it lies inside `root`. Only the words of
    the path are compared (the workers read the folder; this process may not see it)."""
    base = os.path.normpath(os.path.abspath(root))
    full = os.path.normpath(os.path.join(base, path))
    if os.path.commonpath([full, base]) != base:
        raise LoraRefused("invalid", f"{name} {path!r} is outside lora_root ({root}): adapters are loaded from there "
                          "only")  # fmt: skip
    return full


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
        self.lora_modules = {m.name: m for m in config.lora_modules}  # the adapters served, run-time loads included
        self._lora_loading: dict[str, LoraDone] = {}  # loads sent to the workers, waiting for their word
        self._lora_closing: dict[str, LoraDone] = {}  # unloads waiting for their requests to finish

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        lora: str | None = None,
    ) -> Request:
        """Validate and queue a request (through LoRA adapter `lora`, a name in lora_modules). Raises ValueError
        with a message on bad input."""
        request = self.make_request(prompt_ids, params, request_id=request_id, prompt=prompt, lora=lora)
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
        """Validate a request without queueing it (so a caller can check a whole batch first)."""
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
        request.bad_words_ids = self._bad_words_ids(params.bad_words)
        request.prediction_ids = self._prediction_ids(params.prediction)
        request.lora = self._check_lora(lora)
        return request

    def _prediction_ids(self, prediction: str | None) -> list[int]:
        """The prediction as the target tokenizes it (the drafter proposes its tokens), within the bounds."""
        if not prediction:
            return []
        if not hasattr(self.tokenizer, "encode"):
            raise ValueError("prediction: this engine has no tokenizer to turn it into tokens")
        ids = self.tokenizer.encode(prediction, add_special_tokens=False)
        most = min(self.config.max_prediction_tokens, self.max_model_len)
        if len(ids) > most:
            which = "max_prediction_tokens" if most == self.config.max_prediction_tokens else "max_model_len"
            raise ValueError(f"prediction: {len(ids)} tokens is more than this server takes ({most}, its {which})")
        return ids

    def _check_lora(self, name: str | None) -> str | None:
        served = self.lora_adapters
        if name is not None and name not in served:
            raise ValueError(f"unknown LoRA adapter {name!r}: this server has {served or 'none'}")
        return name

    @property
    def lora_adapters(self) -> list[str]:
        """The adapters a new request may run through: not one still loading, nor one being unloaded."""
        return [n for n in self.lora_modules if n not in self._lora_loading and n not in self._lora_closing]

    def load_lora(self, module: LoraModule, done: LoraDone) -> None:
        """Load an adapter while serving (allow_runtime_lora_updating; its folders inside lora_root). It goes to
        every worker with the next step; `done(None)` once all of them hold it, `done(refusal)` naming the file
        if one could not (it is unloaded again). Raises LoraRefused for what is refused before the workers."""
        root = self._check_lora_updating()
        if module.name in self.lora_modules:
            raise LoraRefused("exists", f"LoRA adapter {module.name!r} is already loaded: unload it first")
        draft = module.draft_path and rooted(module.draft_path, root, "draft_path")
        if draft and self.config.speculative_config is not None and (
                self.config.uses_eagle_head or self.config.speculative_config.parallel_drafting
                or self.config.drafts_without_model):
            raise LoraRefused("invalid", "draft_path: a drafter adapter is for draft-model drafting, not EAGLE heads "
                              "or PARD (parallel_drafting)")  # fmt: skip
        module = LoraModule(name=module.name, path=rooted(module.path, root, "lora_path"), draft_path=draft or None)
        self.lora_modules[module.name] = module
        self._lora_loading[module.name] = done
        self.executor.change_loras([module])

    def unload_lora(self, name: str, done: LoraDone) -> None:
        """Unload an adapter: new requests for it are refused from now on; the running and waiting ones finish
        first, then the workers drop it and `done(None)` is called (see `settle_loras`)."""
        self._check_lora_updating()
        if name not in self.lora_adapters:
            raise LoraRefused("not_found", f"LoRA adapter {name!r} is not loaded (loaded: {self.lora_adapters})")
        self._lora_closing[name] = done
        self.settle_loras()

    def settle_loras(self) -> None:
        """Finish each unload whose adapter no request (running, waiting or held) uses any more."""
        if not self._lora_closing:
            return
        in_use = {r.lora for r in self.requests.values()}
        for name in [n for n in self._lora_closing if n not in in_use]:
            del self.lora_modules[name]
            self.executor.change_loras([name])
            self._lora_closing.pop(name)(None)

    def _check_lora_updating(self) -> str:
        if not (self.config.allow_runtime_lora_updating and self.config.lora_root):
            raise LoraRefused("off", "loading and unloading LoRA adapters at run time is off on this server (start it "
                              "with --enable-lora --allow-runtime-lora-updating --lora-root DIR)")  # fmt: skip
        return self.config.lora_root

    def _loras_loaded(self, result: StepResult | None) -> None:
        """The workers' word on the loads a step carried: a load one of them refused is undone everywhere."""
        for name, error in (result.lora_loaded if result is not None else {}).items():
            done = self._lora_loading.pop(name, None)
            if done is None:
                continue
            if error:
                del self.lora_modules[name]
                self.executor.change_loras([name])
            done(LoraRefused("invalid", error) if error else None)

    def flush(self) -> None:
        """Apply pending admissions, releases and adapter changes now (the engine is idle)."""
        self._loras_loaded(self.executor.flush())

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the target tokenizes it, without and with a leading space (as vLLM does): the
        workers ban by token sequences."""
        if words and not hasattr(self.tokenizer, "encode"):
            raise ValueError("bad_words: this engine has no tokenizer to turn them into tokens")
        variants = [self.tokenizer.encode(text, add_special_tokens=False) for word in words
                    for text in (word.lstrip(), " " + word.lstrip())]  # fmt: skip
        return [ids for i, ids in enumerate(variants) if ids and ids not in variants[:i]]

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The bounds that depend on the model, checked before a request reaches any step (the static ones
        are SamplingParams'). Raises ValueError naming the field and its range. Reads only settings fixed at
        start, so the frontends may call it from another thread."""
        if not prompt_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len}: no room "
                             "is left for output")  # fmt: skip
        vocab_size = getattr(self.tokenizer, "vocab_size", None)
        if vocab_size is not None:
            if any(not 0 <= t < vocab_size for t in prompt_ids):
                raise ValueError(f"prompt: token ids must be in [0, {vocab_size})")
            if any(t >= vocab_size for t in params.stop_token_ids):
                raise ValueError(f"stop_token_ids: token ids must be in [0, {vocab_size})")
            if any(t >= vocab_size for t in params.logit_bias):
                raise ValueError(f"logit_bias: token ids must be in [0, {vocab_size})")
            if params.top_k > vocab_size:
                raise ValueError(f"top_k: must be -1 (all) or in [1, {vocab_size}] (the vocabulary size)")
        if params.resumed_tokens >= len(prompt_ids):
            raise ValueError(f"resumed_tokens: must be less than the prompt's {len(prompt_ids)} tokens (at least one "
                             f"is prompt); got {params.resumed_tokens}")  # fmt: skip
        spec = self.config.speculative_config
        most = spec.num_speculative_tokens if spec else self.config.prediction_draft_tokens
        if params.num_speculative_tokens is not None and params.num_speculative_tokens > most:
            raise ValueError(f"num_speculative_tokens: must be in [0, {most}] (the server's num_speculative_tokens); "
                             f"got {params.num_speculative_tokens}")  # fmt: skip
        if params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: must be in [1, {self.max_model_len}] (max_model_len); got {params.max_tokens}"
            )
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)

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
        self._loras_loaded(result)
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
        if self._lora_loading:  # the new world's join brought them; their word comes with the next step
            self.executor.change_loras([self.lora_modules[n] for n in self._lora_loading])
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
