"""Incremental detokenization that never emits half of a multi-byte character."""

from __future__ import annotations

from typing import Protocol

# Tokens of context decoded before the new ones, so that tokenizers which merge or strip
# leading spaces at a word boundary still produce the right text for the new tokens.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    A byte-level BPE token can end in the middle of a UTF-8 character; the decoded text then ends in
    U+FFFD. Such a tail is held back until the tokens that complete the character arrive.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], resumed_tokens: int = 0) -> None:
        """`resumed_tokens`: the prompt's last tokens are output of an earlier run (already streamed). They are
        replayed as output, so a character they leave unfinished comes out whole with the next token, as it
        would have in one run."""
        self._tokenizer = tokenizer
        prompt = prompt_ids[: max(0, len(prompt_ids) - resumed_tokens)]
        self._ids = list(prompt[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        for token_id in prompt_ids[len(prompt) :]:
            self.add(token_id)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that is now final (possibly empty)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever is held back (the request has finished)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > 4 * _CONTEXT_TOKENS:  # keep the list short on long outputs
            drop = self._prefix_offset - _CONTEXT_TOKENS
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return full[len(prefix) :]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=True)
