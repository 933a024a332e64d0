"""Log-probabilities of the sampled tokens, from the target's processed distribution (never the draft's).

A random request's distribution is the one its tokens are drawn from: the logits after its penalties and
biases, then temperature, min_p, top-k and top-p (a token those drop has -inf). A greedy request's is
the softmax of its logits after penalties and biases, at temperature 1 (its sampling distribution is
one-hot, which says nothing), as in vLLM. The verifier computes them on the same rows it verifies with, so
speculative decoding returns what plain decoding returns.

Prompt logprobs (`SamplingParams.prompt_logprobs`) are, as in vLLM, the log_softmax of the target's raw
logits at the position before each prompt token: no penalty, bias, grammar or temperature applies to the
prompt. The verifier computes them on the rows where it writes the prompt (prefill chunks included).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from minedraft.sampling.params import SamplingParams, TokenLogprob
from minedraft.sampling.sampler import processed_probs


def token_logprobs(logits: Tensor, params_list: Sequence[SamplingParams], tokens: Sequence[int]) -> list[TokenLogprob]:
    """One TokenLogprob per row of ``logits`` [n, V] (penalties and biases applied already): the row's
    distribution at ``tokens[i]``, and its top ``params_list[i].logprobs`` tokens."""
    if not len(params_list) == len(tokens) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows, {len(params_list)} params, {len(tokens)} tokens")
    if not tokens:
        return []
    logprobs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    greedy = [i for i, p in enumerate(params_list) if p.greedy]
    random = [i for i, p in enumerate(params_list) if not p.greedy]
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        logprobs[index] = logits[index].float().log_softmax(dim=-1)
    if random:
        index = torch.tensor(random, device=logits.device)
        logprobs[index] = processed_probs(logits[index], [params_list[i] for i in random]).log()
    chosen = logprobs.gather(1, torch.tensor(list(tokens), device=logits.device)[:, None]).squeeze(1).tolist()
    width = max(p.logprobs or 0 for p in params_list)
    top = logprobs.topk(min(width, logits.shape[-1]), dim=-1) if width else None
    top_ids, top_values = (top.indices.tolist(), top.values.tolist()) if top else ([[]] * len(tokens),) * 2
    return [
        TokenLogprob(value, ids[: p.logprobs or 0], values[: p.logprobs or 0])
        for value, ids, values, p in zip(chosen, top_ids, top_values, params_list)
    ]


def prompt_token_logprobs(logits: Tensor, tokens: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """One TokenLogprob per row of raw ``logits`` [n, V]: log_softmax at ``tokens[i]``, and its top ``num_top``."""
    if logits.shape[0] != len(tokens):
        raise ValueError(f"{logits.shape[0]} logits rows, {len(tokens)} tokens")
    if not tokens:
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(list(tokens), device=logits.device)[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    if not num_top:
        return [TokenLogprob(value, [], [], rank) for value, rank in zip(chosen, ranks)]
    top = logprobs.topk(min(num_top, logits.shape[-1]), dim=-1)
    return [TokenLogprob(value, ids, values, rank)
            for value, ids, values, rank in zip(chosen, top.indices.tolist(), top.values.tolist(), ranks)]  # fmt: skip
