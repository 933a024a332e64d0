"""The engine loop: requests in, steps through a pipeline on an executor, tokens out."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from minedraft.config import EngineConfig, num_slots
from minedraft.engine.detokenizer import Decoder
from minedraft.engine.pipelines import make_pipeline
from minedraft.engine.plans import Admission, Executor, StepResult
from minedraft.engine.request import Request, SpecDecodeStats
from minedraft.sampling.params import SamplingParams


@dataclass
class StepStats:
    """Step counters summed over the engine's life; averages are what benchmarks report."""

    num_steps: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    step_seconds: float = 0.0

    def add(self, result: StepResult) -> None:
        self.num_steps += 1
        self.draft_seconds += result.draft_seconds
        self.verify_seconds += result.verify_seconds
        self.step_seconds += result.step_seconds


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
        self.requests: dict[str, Request] = {}
        self.step_stats = StepStats()
        self.last_step: StepResult | None = None
        self.spec_stats = SpecDecodeStats()
        self._seeds = random.Random(config.seed)
        self._ids = itertools.count()

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> Request:
        """Validate and queue a request. Raises ValueError with a message on bad input."""
        request = self.make_request(prompt_ids, params, request_id=request_id, prompt=prompt)
        self.enqueue(request)
        return request

    def make_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> Request:
        """Validate a request without queueing it (so a caller can check a whole batch first)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab_size = getattr(self.tokenizer, "vocab_size", None)
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        return Request.create(
            request_id,
            prompt_ids,
            params,
            seed=params.seed if params.seed is not None else self._seeds.getrandbits(63),
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            tokenizer=self.tokenizer,
            prompt=prompt,
        )

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
        if self.pipeline.batches.abort_waiting(request_id) is not None:
            del self.requests[request_id]
        else:
            request.abort()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[Request]:
        """Run one step; return the requests that got new tokens or finished in it."""
        self.last_step = None
        self._release_finished()
        admitted, draft, verify = self.pipeline.schedule()
        if admitted:
            self.executor.admit(
                [Admission(r.request_id, r.prompt_ids + r.output_ids, r.params, r.seed, r.batch) for r in admitted]
            )
        if draft is None and verify is None:
            return []
        result = self.executor.step(draft, verify)
        self.step_stats.add(result)
        self.last_step = result
        touched = []
        for verified in result.verified:
            request = self.requests.get(verified.request_id)
            if request is None:
                continue
            request.pending_drafts = None
            request.stats.record(verified.num_draft_tokens, verified.num_accepted)
            self.spec_stats.record(verified.num_draft_tokens, verified.num_accepted)
            if not request.finished:  # aborted during the step: its tokens are dropped
                request.append_tokens(verified.token_ids)
            touched.append(request)
        for request_id, num_tokens in result.drafted.items():
            if request_id in self.requests:
                self.requests[request_id].pending_drafts = num_tokens
        touched.extend(r for r in self._release_finished() if r not in touched)
        return touched

    def restart(self, speculate: bool) -> None:
        """The workers lost every request (a worker died, a new world was formed): start each unfinished
        request again from its prompt and the tokens it has so far, in arrival order, speculating or (without
        a drafter) target-only. The workers re-prefill them; no token already produced changes."""
        batches = self.pipeline.batches
        running = sorted((r for b in batches.batches for r in b), key=lambda r: r.arrival_time)
        for request in [r for r in running if r.finished]:
            del self.requests[request.request_id]
        self.speculating = speculate and self.config.speculative_config is not None
        self.pipeline = make_pipeline(self.config if self.speculating else self.config.target_only())
        for request in running + list(batches.waiting):
            if not request.finished:
                request.restart()
                self.pipeline.batches.add(request)

    @classmethod
    def local(cls, config: EngineConfig) -> LLMEngine:
        """Drafter and verifier in this process (the offline API and the tests)."""
        from minedraft.engine.local_executor import build_local_executor

        executor, runner = build_local_executor(config, num_slots=num_slots(config))
        return cls(
            config,
            executor,
            runner.tokenizer,
            runner.config.eos_token_ids,
            runner.max_seq_len,
        )

    def _release_finished(self) -> list[Request]:
        done = self.pipeline.batches.remove_finished()
        if done:
            self.executor.release([r.request_id for r in done])
            for r in done:
                del self.requests[r.request_id]
        return done
