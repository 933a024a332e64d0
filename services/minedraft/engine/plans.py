"""What the engine asks of its workers each step, and what comes back.

A step has a draft part (run by the drafter) and a verify part (run by the verifier); either may be
absent. Both parts run at the same time, then the step ends at a synchronisation point where
verification results go to the drafter and the new drafts go to the verifier. Every decoding mode is a
sequence of such steps:

- ar:        verify-only steps with no drafts;
- sd:        a draft-only step, then a verify-only step, on one batch;
- pearl:     verify a batch while drafting its continuation (assuming all drafts are accepted);
- minedraft: draft batch X while batch Y is verified, then swap.

The plans carry only request ids and small integers so that they travel cheaply as protobuf; the tokens
themselves stay with the workers, who exchange them directly (in one process, or over NCCL / gloo).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from minedraft.config import LoraModule
from minedraft.sampling.params import SamplingParams, TokenLogprob

if TYPE_CHECKING:  # the schedules and the scheduler import this module without torch's cost
    import torch

    from minedraft.engine.adaptive.shapes import StepChoice

# A change to the LoRA adapters served, made while serving: an adapter to load, or the name of one to unload.
LoraChange = LoraModule | str


@dataclass(frozen=True)
class Admission:
    """What a worker needs to hold a request: its tokens so far and how to sample."""

    request_id: str
    token_ids: list[int]  # prompt (+ output so far, when a worker re-admits a running request)
    params: SamplingParams
    seed: int
    batch: int = 0  # the engine's batch it runs in
    num_prompt_tokens: int | None = None  # how many of token_ids are prompt (penalties count the rest); None: all
    bad_words_ids: list[list[int]] = field(default_factory=list)  # token sequences the output must not hold
    lora: str | None = None  # the LoRA adapter the request runs through (its drafter adapter, where one exists)
    prediction_ids: list[int] = field(default_factory=list)  # the output the client predicts (Predicted Outputs)


@dataclass(frozen=True)
class DraftTask:
    request_id: str
    num_tokens: int  # draft tokens to propose (k, or k + e with Tetris)
    # PEARL: draft on from the window handed over last step, which is being verified right now,
    # assuming all of it is accepted. The new drafts are dropped at the step's end unless it was.
    continue_window: bool = False
    # The length the request's sequence stops at (its prompt and its most new tokens; 0: not given): a window
    # ends a token before it, the verification adding one of its own. A plan made before the step's results
    # (planned ahead, or drafting after this step's verification) caps its windows with what the drafter holds
    # when it drafts, as a plan made after them would.
    end: int = 0


@dataclass(frozen=True)
class PrefillTask:
    """Chunked prefill: write the request's tokens up to `num_tokens` into the KV cache, sample nothing.
    Both workers get the same chunks in the same step; the last token is left to the first draft/verify."""

    request_id: str
    num_tokens: int  # the cache holds token_ids[:num_tokens] after this step


@dataclass(frozen=True)
class DraftPlan:
    tasks: list[DraftTask]
    tetris_capacity: int | None = None  # with Tetris: draft tokens kept over the whole batch
    prefill: list[PrefillTask] = field(default_factory=list)
    # One-batch speculation: draft after this step's verification, from its results (the step verifies the
    # windows held and drafts the next ones, one step a window), not beside it.
    after_verify: bool = False

    @property
    def num_tokens(self) -> int:
        """Draft tokens the plan proposes over its requests."""
        return sum(t.num_tokens for t in self.tasks)


@dataclass(frozen=True)
class VerifyTask:
    request_id: str
    # False when the drafter continues this request (PEARL): if every draft is accepted, the target's
    # bonus token is dropped and the continuation is verified next instead. Still lossless.
    keep_bonus: bool = True


@dataclass(frozen=True)
class VerifyPlan:
    tasks: list[VerifyTask]
    prefill: list[PrefillTask] = field(default_factory=list)

    def request_ids(self) -> list[str]:
        """Every request the verifier's forward writes, in plan order (windows, then prefill chunks), once."""
        return list(dict.fromkeys([t.request_id for t in self.tasks] + [p.request_id for p in self.prefill]))


@dataclass
class Drafts:
    """One request's draft window, as the drafter hands it to the verifier: the tokens, the draft
    probability of each, and the sparse q each was sampled from (one row of ids and probs per token)."""

    tokens: list[int] = field(default_factory=list)
    token_probs: list[float] = field(default_factory=list)
    q_ids: list[torch.Tensor] = field(default_factory=list)
    q_probs: list[torch.Tensor] = field(default_factory=list)

    def truncate(self, n: int) -> None:
        for part in (self.tokens, self.token_probs, self.q_ids, self.q_probs):
            del part[n:]


@dataclass(frozen=True)
class Verified:
    """One request's verification: the new tokens (accepted drafts + at most one target token)."""

    request_id: str
    token_ids: list[int]
    num_draft_tokens: int
    num_accepted: int
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for logprobs
    # Once, in a request's first verification when it asked for prompt_logprobs: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class StepResult:
    verified: list[Verified] = field(default_factory=list)
    # Draft tokens handed to the verifier at the step's end, per request (after Tetris and after
    # discarding PEARL continuations whose window was rejected).
    drafted: dict[str, int] = field(default_factory=dict)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    step_seconds: float = 0.0
    # Per worker role, when the workers run apart: the step's time on it, and its wait for the step's plan.
    worker_seconds: dict[str, float] = field(default_factory=dict)
    idle_seconds: dict[str, float] = field(default_factory=dict)
    # The work those seconds paid for (the adaptive controller's cost model): the draft model's forwards and the
    # tokens fed to it, and the tokens fed to the target (drafts, pending tokens, prompts and prefill chunks alike).
    # (Not draft tokens proposed, DraftPlan.num_tokens, nor verified, Verified.num_draft_tokens.)
    draft_forwards: int = 0
    fed_to_draft: int = 0
    fed_to_target: int = 0
    # Per worker role: prompt tokens its admissions looked up in its prefix cache, and those it found there.
    prefix_cache_queries: dict[str, int] = field(default_factory=dict)
    prefix_cache_hits: dict[str, int] = field(default_factory=dict)

    # Each adapter this step's plan loaded: "" when every worker holds it now, else why one could not.
    lora_loaded: dict[str, str] = field(default_factory=dict)
    # A part ran on a thread count being tried, not the best known (engine/adaptive/threads.py): a slower count's step
    # says nothing of its shape (the adaptive controller does not judge shapes by it).
    thread_trial: bool = False
    # The draft part ran after the verify part, from its results (DraftPlan.after_verify), not beside it.
    draft_after_verify: bool = False
    # A drafter shared by several groups (a pool member): other groups' draft parts waiting for its model when
    # this step's came, and the seconds this one waited.
    drafter_queue: int = 0
    drafter_wait_seconds: float = 0.0
    # How the engine chose the step (its shape, the adaptive decision's windows): set by the engine when it collects
    # the result, from the record the step carried in flight; the workers leave it None.
    choice: StepChoice | None = None

    def record_prefix_cache(self, role: str, stats: tuple[int, int]) -> None:
        self.prefix_cache_queries[role], self.prefix_cache_hits[role] = stats


class Executor(Protocol):
    """Runs steps on a drafter/verifier pair: in one process, or across processes and pods.

    `submit` hands a step over and `collect` returns the oldest submitted step's result, in order; up to
    `max_in_flight` steps may be submitted and not collected (2 where the workers can take the next plan
    while one runs). `step` is submit and collect at once."""

    max_in_flight: int

    @property
    def kv_pool(self) -> tuple[int, int] | None:
        """(blocks, tokens per block) of the verifier's pool in the current world: the engine admits by it
        (and by `draft_kv_blocks`) and reads both again whenever it restarts over a new world. None: admit by
        max_num_seqs only."""

    @property
    def draft_kv_blocks(self) -> int | None:
        """The drafter's blocks (of the same size) when the current world has a drafter."""

    def admit(self, seqs: list[Admission]) -> None: ...

    def release(self, request_ids: list[str]) -> None: ...

    def change_loras(self, changes: list[LoraChange]) -> None:
        """Load or unload LoRA adapters on every worker with the next step (or `flush`), before its admissions;
        that step's result says, in `lora_loaded`, whether each load took."""

    def submit(self, draft: DraftPlan | None, verify: VerifyPlan | None) -> None: ...

    def collect(self) -> StepResult: ...

    def step(self, draft: DraftPlan | None, verify: VerifyPlan | None) -> StepResult: ...

    def flush(self) -> StepResult | None:
        """Apply pending admissions, releases and adapter changes now (the engine is idle); the result of the
        step that carried them, if one was needed."""

    def close(self) -> None: ...
