"""A request's lifecycle: tokens in, tokens and text out, stop conditions, statistics."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from minedraft.engine.detokenizer import Decoder, IncrementalDetokenizer
from minedraft.engine.lookup import prediction_usage
from minedraft.sampling.params import SamplingParams, TokenLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecDecodeStats:
    """Speculative-decoding counters of one request (or summed over many), named as in vLLM."""

    num_drafts: int = 0  # verifications that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend([0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = other.num_accepted_tokens_per_pos
        if len(self.num_accepted_tokens_per_pos) < len(per_pos):
            self.num_accepted_tokens_per_pos.extend([0] * (len(per_pos) - len(self.num_accepted_tokens_per_pos)))
        for pos, count in enumerate(per_pos):
            self.num_accepted_tokens_per_pos[pos] += count

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification that carried drafts: accepted drafts + the target's token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(eq=False)
class Request:
    """Everything the engine knows of one request; the engine is its single source of truth."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int  # max_tokens clipped to what max_model_len leaves
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    prompt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per output token, when params.logprobs asks for them
    # One per prompt token after the first, when params.prompt_logprobs asks (empty until the first verification).
    prompt_logprobs: list[TokenLogprob] | None = None
    bad_words_ids: list[list[int]] = field(default_factory=list)  # params.bad_words as the target tokenizes them
    lora: str | None = None  # the LoRA adapter it runs through (a name in the engine's lora_modules)
    prediction_ids: list[int] = field(default_factory=list)  # params.prediction as the target tokenizes it
    # Once finished with a prediction: (accepted, rejected) prediction tokens over its whole output (an earlier
    # run's included), as OpenAI's usage counts them; a gateway's mirror takes the group's.
    prediction_usage: tuple[int, int] | None = None
    text: str = ""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why it failed, with finish_reason "error"
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    num_rejections: int = 0  # verifications that rejected a draft token (adaptive k reads its acceptance)
    plain_steps: int = 0  # steps since it last verified drafts (adaptive k lets its own acceptance fade meanwhile)
    # Its tokens the drafter had read when a step last drafted it (0 from each admission): the drafter reads the
    # rest, the catch-up, before it drafts the request again (adaptive speculation weighs that).
    drafter_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # when it first left the waiting queue for a batch
    first_token_time: float | None = None
    finish_time: float | None = None
    pending_drafts: int | None = None  # draft tokens the verifier holds for it, to verify; None = not drafted
    batch: int = 0  # which of the engine's batches it runs in
    num_prefilled: int | None = None  # chunked prefill: tokens both workers hold so far (None: not prefilling)
    admitted_in: int = 0  # the engine's step that last admitted it to the workers
    # Prefix sharing as admission counts it (engine/batch_manager.py): chain keys of the full blocks its tokens
    # started with when admitted (None: not computed yet), and how many leading ones the verifier shares.
    prefix_keys: list[bytes] | None = None
    shared_blocks: int = 0
    _streamed: int = 0  # characters of text already handed to a stream

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        seed: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        tokenizer: Decoder,
        prompt: str | None = None,
    ) -> Request:
        if not prompt_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if len(prompt_ids) >= max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but max_model_len is {max_model_len}: no room is left for output"
            )
        return cls(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            seed=seed,
            max_new_tokens=min(params.max_tokens, max_model_len - len(prompt_ids)),
            eos_token_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids),
            detokenizer=IncrementalDetokenizer(tokenizer, prompt_ids, params.resumed_tokens),
            prompt=prompt,
            logprobs=None if params.logprobs is None else [],
            prompt_logprobs=None if params.prompt_logprobs is None else [],
        )

    @property
    def remaining_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens that are prompt: the prompt's last `resumed_tokens` are output of an earlier run."""
        return len(self.prompt_ids) - self.params.resumed_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output so far as min_tokens and the penalties count it: the resumed tokens included."""
        return len(self.output_ids) + self.params.resumed_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_tokens(self, token_ids: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Take newly verified tokens (and their logprobs, if it asked) one by one, stopping at the first stop
        condition.

        Tokens after a stop are dropped, exactly as if decoding had stopped there.
        """
        for i, token_id in enumerate(token_ids):
            if self.first_token_time is None:
                self.first_token_time = time.monotonic()
            self.output_ids.append(token_id)
            if self.logprobs is not None and logprobs is not None:
                self.logprobs.append(logprobs[i])
            delta = self.detokenizer.add(token_id)
            if token_id in self.eos_token_ids:
                self._finish("stop")
            elif len(self.output_ids) >= self.max_new_tokens:
                self._finish("length")
            if self.finished:
                delta += self.detokenizer.flush()
            self._append_text(delta)
            if self.finished:
                return

    def take_stream_delta(self) -> str:
        """Text that is final and not yet streamed.

        While running, the last len(longest stop string) - 1 characters are held back: they could
        still turn out to be the start of a stop string, which is never shown.
        """
        end = len(self.text)
        if not self.finished and self.params.stop:
            end -= max(len(s) for s in self.params.stop) - 1
        if end <= self._streamed:
            return ""
        delta = self.text[self._streamed : end]
        self._streamed = end
        return delta

    def _append_text(self, delta: str) -> None:
        """Add text; cut it before the first stop string that the new text completes."""
        if not delta:
            return
        if self.params.stop and self.num_output_tokens >= self.params.min_tokens:  # as vLLM: none before min_tokens
            tail_start = max(0, len(self.text) - max(len(s) for s in self.params.stop) + 1)
            tail = self.text[tail_start:] + delta
            hits = [i for i in (tail.find(s) for s in self.params.stop) if i >= 0]
            if hits:
                self.text = (self.text[:tail_start] + tail)[: tail_start + min(hits)]
                self._finish("stop")
                return
        self.text += delta

    @property
    def num_tokens(self) -> int:
        """Prompt and output so far (`token_ids`' length, without building the list)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        """What a worker holds for the request when it is (re-)admitted: prompt and output so far."""
        return self.prompt_ids + self.output_ids

    def finish_as(self, reason: str) -> None:
        """Finish for a reason decided elsewhere (a mirror of a request that ran on another engine, e.g. its
        EOS): the held-back text is final, and a stop string it completes still wins."""
        if self.finished:
            return
        self._append_text(self.detokenizer.flush())
        self._finish(reason)

    def record_verification(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification of its window (of 0 tokens: a plain step)."""
        self.stats.record(num_draft_tokens, num_accepted)
        self.num_rejections += num_accepted < num_draft_tokens
        self.plain_steps = 0 if num_draft_tokens else self.plain_steps + 1

    def restart(self) -> None:
        """Back to the waiting queue, to be admitted again with its tokens so far (nothing is in flight):
        after a preemption, or when the workers lost every request."""
        self.status = RequestStatus.WAITING
        self.pending_drafts = None
        self.num_prefilled = None
        self.prefix_keys, self.shared_blocks = None, 0

    def abort(self) -> None:
        self._finish("abort")

    def fail(self, error: str) -> None:
        """Finish with an error of this request's own: the others are not affected."""
        if not self.finished:
            self.error = error
            self._finish("error")

    def _finish(self, reason: str) -> None:
        if not self.finished:
            self.status = RequestStatus.FINISHED
            self.finish_reason = reason
            self.finish_time = time.monotonic()
            if self.prediction_ids:
                output = self.prompt_ids[self.num_prompt_tokens :] + self.output_ids
                self.prediction_usage = prediction_usage(self.prediction_ids, output)
