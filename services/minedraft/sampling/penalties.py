"""Logits processing that depends on the tokens before a position: bad words, min_tokens, logit_bias,
penalties.

Applied to the raw logits, before temperature, min_p, top-k and top-p, in vLLM's order and with its
meanings:

- bad_words (as token sequences): the last token of a sequence gets -inf where the output ends with the
  tokens before it (a one-token word is banned everywhere);
- min_tokens: while the output is shorter, the stop tokens (``stop_token_ids``, and the EOS tokens unless
  ``ignore_eos``) get -inf;
- logit_bias: added to the named tokens' logits;
- repetition_penalty r, over the tokens of the prompt and of the output: a positive logit is divided by r,
  a negative one multiplied;
- frequency_penalty f and presence_penalty p, over the output only: f x (times the token occurs) and p
  (if it occurs at all) are subtracted.

Greedy requests take the argmax of the processed logits.

What keeps speculative decoding lossless: each logits row is processed with the history its own position
has. The verifier's row for draft i sees the committed tokens and drafts 1..i-1 (`History.extra`), so it
is exactly the row plain decoding would process there whenever those drafts are accepted, which is the
only case in which the row is used. The drafter may process its rows the same way (it raises acceptance),
but the rejection rule never depends on it: it takes q as the drafter reports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from minedraft.sampling.params import SamplingParams


@dataclass(frozen=True)
class History:
    """The tokens before one logits row: a request's committed tokens (prompt, then output so far), how many
    of them are prompt, and the tokens after them up to the row (the drafts before it). Rows of one request
    share its `tokens` list, which is counted once per call."""

    tokens: Sequence[int]
    num_prompt: int
    extra: Sequence[int] = ()
    bad_words_ids: Sequence[Sequence[int]] = ()  # the request's bad words as token sequences (not history, but
    # the one other thing a row's processing reads per request)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt + len(self.extra)


def apply_penalties(
    logits: Tensor, params_list: Sequence[SamplingParams], histories: Sequence[History], eos_token_ids: Sequence[int]
) -> Tensor:
    """Logits [m, V] with each row's bad words, min_tokens, logit_bias and penalties applied (float32; the rows
    that ask for none are left as they are, and with none in the batch the tensor itself comes back)."""
    if len(params_list) != logits.shape[0] or len(histories) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows, {len(params_list)} params, {len(histories)} histories")
    rows = [i for i, p in enumerate(params_list) if p.penalized]
    if not rows:
        return logits
    logits = logits.float()
    index = torch.tensor(rows, device=logits.device)
    processed = _processed(logits[index], [params_list[i] for i in rows], [histories[i] for i in rows],
                           eos_token_ids)  # fmt: skip
    return processed if len(rows) == logits.shape[0] else logits.index_copy(0, index, processed)


def _processed(
    logits: Tensor, params_list: list[SamplingParams], histories: list[History], eos_token_ids: Sequence[int]
) -> Tensor:
    counts, in_prompt = _token_counts(histories, logits.shape[-1], logits.device)
    logits = _mask(logits, _bad_words(histories, logits.shape[-1]))
    logits = _mask_stop_tokens(logits, params_list, histories, eos_token_ids)
    logits = _add_bias(logits, params_list)
    column = lambda values: torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]  # noqa: E731
    repetition = column([p.repetition_penalty for p in params_list])
    seen = in_prompt | (counts > 0)
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    frequency = column([p.frequency_penalty for p in params_list])
    presence = column([p.presence_penalty for p in params_list])
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def _token_counts(histories: list[History], vocab: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Per row: how often each token occurs in the output before it [m, V] float32, and which tokens the
    prompt holds [m, V] bool. Ids at or past ``vocab`` (a draft model with a smaller vocabulary) are left out."""
    base: dict[int, tuple[Tensor, Tensor]] = {}
    for history in histories:
        if id(history.tokens) not in base:
            tokens = torch.tensor(list(history.tokens), dtype=torch.long, device=device)
            base[id(history.tokens)] = (_bincount(tokens[history.num_prompt :], vocab).float(),
                                        _bincount(tokens[: history.num_prompt], vocab) > 0)  # fmt: skip
    counts = torch.stack([base[id(h.tokens)][0] for h in histories])
    in_prompt = torch.stack([base[id(h.tokens)][1] for h in histories])
    extra = [(row, t) for row, h in enumerate(histories) for t in h.extra if t < vocab]
    if extra:
        at = torch.tensor(extra, dtype=torch.long, device=device)
        counts.index_put_((at[:, 0], at[:, 1]), torch.ones(len(extra), device=device), accumulate=True)
    return counts, in_prompt


def _bincount(tokens: Tensor, vocab: int) -> Tensor:
    return torch.bincount(tokens[tokens < vocab], minlength=vocab)


def _bad_words(histories: list[History], vocab: int) -> list[tuple[int, int]]:
    """(row, token) for each bad word's last token whose other tokens end the row's output."""
    banned = []
    for row, h in enumerate(histories):
        if not h.bad_words_ids:
            continue
        longest = max(len(word) for word in h.bad_words_ids) - 1
        start = max(h.num_prompt, len(h.tokens) - longest)
        tail = [*h.tokens[start:], *h.extra][-longest:] if longest else []
        for *prefix, last in h.bad_words_ids:
            if last < vocab and (not prefix or tail[len(tail) - len(prefix) :] == prefix):
                banned.append((row, last))
    return banned


def _mask(logits: Tensor, banned: list[tuple[int, int]]) -> Tensor:
    if banned:
        at = torch.tensor(banned, dtype=torch.long, device=logits.device)
        logits[at[:, 0], at[:, 1]] = float("-inf")
    return logits


def _mask_stop_tokens(
    logits: Tensor, params_list: list[SamplingParams], histories: list[History], eos_token_ids: Sequence[int]
) -> Tensor:
    vocab = logits.shape[-1]
    banned = [
        (row, t)
        for row, (p, h) in enumerate(zip(params_list, histories))
        if h.num_output < p.min_tokens
        for t in {*p.stop_token_ids, *([] if p.ignore_eos else eos_token_ids)}
        if t < vocab
    ]
    return _mask(logits, banned)


def _add_bias(logits: Tensor, params_list: list[SamplingParams]) -> Tensor:
    vocab = logits.shape[-1]
    biases = [(row, t, b) for row, p in enumerate(params_list) for t, b in p.logit_bias.items() if t < vocab]
    if biases:
        rows, tokens, values = zip(*biases)
        at = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(at, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)
    return logits
