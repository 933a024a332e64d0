"""A request as a worker holds it: a mirror of the committed tokens beside the tokens its KV cache holds.

Before every forward a worker compares the two: the common prefix stays, everything after it is overwritten (a
rollback is just a smaller start position), and the last committed token is always fed again when needed so
that its logits exist. This one rule covers prefill, verification, rollback after rejection, and PEARL's
continuation windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minedraft.sampling.params import SamplingParams, TokenLogprob
from minedraft.sampling.penalties import History

if TYPE_CHECKING:  # xgrammar is optional: sampling.grammar is imported when a request asks for a grammar
    from minedraft.sampling.grammar import GrammarState

_TAIL_SCAN = 64


@dataclass
class _Sequence:
    slot: int  # the sequence's id in the runner's KV cache
    tokens: list[int]  # committed tokens (prompt + verified output), mirrored from the engine
    params: SamplingParams
    seed: int  # with the output position, keys every random draw (sampling/streams.py)
    kv_tokens: list[int] = field(default_factory=list)  # what the KV cache holds, position by position
    num_prompt: int = 0  # tokens[:num_prompt] are the prompt: penalties count what follows
    bad_words_ids: list[list[int]] = field(default_factory=list)
    grammar: GrammarState | None = None  # structured output: the matcher over the committed output
    # prompt_logprobs: those of prompt tokens 1.. computed so far (rank 0's); None once sent or never asked
    prompt_lps: list[TokenLogprob] | None = None
    prompt_rows_done: int = 0  # prompt tokens 1.. whose rows a forward has produced (every rank counts them)
    cached_features: int = 0  # a verifier keeping features: positions reused from its cache, not yet handed on

    def owed_prompt_rows(self, start: int, num_rows: int) -> int:
        """How many of `num_rows` rows at positions start.. predict a prompt token whose logprob is still owed
        (position q predicts token q + 1); counts them as produced."""
        if self.params.prompt_logprobs is None or start != self.prompt_rows_done:
            return 0
        owed = max(0, min(start + num_rows, self.num_prompt - 1) - start)
        self.prompt_rows_done += owed
        return owed

    @property
    def output(self) -> list[int]:
        """The committed tokens after the prompt (on a resumed request, those of its earlier run included)."""
        return self.tokens[self.num_prompt :]

    def history(self, base: list[int] | None = None, extra: list[int] = ()) -> History:
        """The tokens before a row that follows `base` (default: the committed tokens) and then `extra`."""
        return History(self.tokens if base is None else base, self.num_prompt, extra, self.bad_words_ids)

    def pending(self, target: list[int]) -> tuple[int, list[int]]:
        """Where to start writing, and the tokens to write, so the cache ends up holding `target`.

        At least the last token is always rewritten: its logits are what the next step samples from.
        """
        limit = min(len(self.kv_tokens), len(target) - 1)
        # Differences sit near the end (rejected drafts), so compare the long head in one C-level
        # list comparison and scan only the tail.
        keep = max(0, limit - _TAIL_SCAN)
        if self.kv_tokens[:keep] != target[:keep]:
            keep = 0
        while keep < limit and self.kv_tokens[keep] == target[keep]:
            keep += 1
        return keep, target[keep:]
