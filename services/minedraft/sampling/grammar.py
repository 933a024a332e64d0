"""Structured output: each logits row keeps only the tokens a grammar allows at its position (xgrammar).

Imported only when a request asks for structured output (xgrammar is the optional extra `structured`).

What keeps speculative decoding lossless is the rule of `sampling/penalties.py`: each row is masked with
the grammar state its own position has. A request's matcher has accepted its committed output; for a row
after drafts (the verifier's row i follows drafts 1..i-1, a drafter's row follows the window drafted so
far) the matcher accepts those tokens, fills the row's mask and rolls them back. A draft the grammar does
not allow gets probability 0 in the verifier's row before it, so it is always rejected, and the rows after
it (never used) are left unmasked. The drafter masks its rows the same way only to keep acceptance high.
Masks depend on the tokens alone, so every process that computes one computes the same.

JSON is generated compact (no free whitespace between its tokens), so a model cannot run on in whitespace.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import xgrammar as xgr
from torch import Tensor

from minedraft.model.tokenizer import Tokenizer
from minedraft.sampling.params import StructuredOutputs

_COMPILE_THREADS = 2


def check_grammar(structured: StructuredOutputs) -> None:
    """Raise ValueError naming what is wrong with a schema or a regex (no tokenizer needed: the engine
    checks every request before it reaches a worker)."""
    _check_source(*structured.key)


@lru_cache(maxsize=256)
def _check_source(kind: str, source: object) -> None:
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(source, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(source)
    except Exception as exc:  # xgrammar raises RuntimeError or its own InvalidJSONError
        raise ValueError(f"structured_outputs.{kind}: {str(exc).splitlines()[-1]}") from None


def _choice_grammar(choices: Sequence[str]) -> str:
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarBook:
    """One tokenizer's grammars: compiled once per source (a compiled grammar holds the token masks)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        backend = tokenizer.backend
        encoded = [""] * vocab_size
        for token, token_id in backend.get_vocab(with_added_tokens=True).items():
            if token_id < vocab_size:
                encoded[token_id] = token
        # How the vocabulary encodes bytes (byte-level, byte fallback, raw), read from tokenizer.json.
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        info = xgr.TokenizerInfo(
            encoded,
            meta["vocab_type"],
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids),
            add_prefix_space=meta["add_prefix_space"],
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS)
        self.compiled = lru_cache(maxsize=256)(self._compile)

    def _compile(self, key: tuple[str, object]) -> xgr.CompiledGrammar:
        kind, source = key
        if kind == "json":
            return self._compiler.compile_json_schema(source, any_whitespace=False)
        if kind == "json_object":
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return self._compiler.compile_regex(source)
        return self._compiler.compile_grammar(_choice_grammar(source))

    def state(self, structured: StructuredOutputs, num_prompt: int) -> GrammarState:
        return GrammarState(xgr.GrammarMatcher(self.compiled(structured.key)), num_prompt)


@dataclass
class GrammarState:
    """One request's matcher, advanced through its committed output (prompt tokens are not matched)."""

    matcher: xgr.GrammarMatcher
    num_prompt: int
    num_matched: int = 0  # output tokens the matcher has accepted
    broken: bool = False  # the output left the grammar (only where a row could not be masked: see `masked`)

    def sync(self, tokens: Sequence[int]) -> None:
        """Accept the committed output the matcher has not seen yet."""
        for token in tokens[self.num_prompt + self.num_matched :]:
            self.broken = self.broken or not self.matcher.accept_token(token)
            self.num_matched += 1

    def fill(self, bitmask: Tensor, row: int, after: Sequence[int]) -> bool:
        """Fill bitmask[row] with the tokens allowed after the committed output and then `after`; False (row
        left as it is) where `after` leaves the grammar or ends it."""
        accepted = 0
        try:
            for token in after:
                if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                    return False
                accepted += 1
            if self.broken or self.matcher.is_terminated():
                return False
            self.matcher.fill_next_token_bitmask(bitmask, row)
            return True
        finally:
            if accepted:
                self.matcher.rollback(accepted)


def masked(logits: Tensor, rows: Sequence[tuple[GrammarState | None, Sequence[int]]], vocab_size: int) -> Tensor:
    """Logits [m, W] (as float32) with -inf where each row's grammar forbids the token. `rows`: per row, its
    request's state (None: no grammar) and the tokens between the committed output and the row. Columns at
    or past `vocab_size` are forbidden in constrained rows. A row the mask would leave with no token at all
    (a drafter whose vocabulary misses every allowed token, or options that ban the only ones) is left as
    it was."""
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    filled = [i for i, (state, after) in enumerate(rows) if state is not None and state.fill(bitmask, i, after)]
    if not filled:
        return logits
    index = torch.tensor(filled, device=logits.device)
    allowed = _unpacked(bitmask[filled].to(logits.device), logits.shape[-1], vocab_size)
    before = logits[index].float()
    after = before.masked_fill(~allowed, float("-inf"))
    after = torch.where((after > float("-inf")).any(dim=-1, keepdim=True), after, before)
    return logits.float().index_copy(0, index, after)


# Bit j of byte value b, for every b: unpacks a bitmask one byte at a time (bit order: token order).
_BYTE_BITS = (torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1 == 1


def _unpacked(bitmask: Tensor, width: int, vocab_size: int) -> Tensor:
    """[rows, ceil(V / 32)] int32 bitmasks as [rows, width] bool; columns at or past vocab_size are False."""
    words = bitmask.contiguous().view(torch.uint8).long()  # little-endian: byte k of a word holds bits 8k..8k+7
    bits = _BYTE_BITS.to(bitmask.device)[words].reshape(bitmask.shape[0], -1)
    usable = min(width, vocab_size)
    allowed = torch.zeros(bitmask.shape[0], width, dtype=torch.bool, device=bitmask.device)
    allowed[:, :usable] = bits[:, :usable]
    return allowed
