"""Lossless verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

For a random request, draft d_i (drawn from q_i) is accepted with probability min(1, p_i(d_i) / q_i(d_i));
at the first rejection the output is drawn from normalise(max(0, p_i - q_i)), and if every draft is
accepted a bonus token is drawn from p_{n+1}. Each emitted token is then distributed exactly as p,
the target's distribution under the request's own temperature/top-k/top-p. Greedy requests accept
while the draft equals the target argmax and then emit the argmax, which reproduces argmax decoding.

A random request draws exactly len(drafts) + 1 uniforms from its generator per call (one per
acceptance test, one for the final token), whatever the outcome or the rest of the batch.
"""

from __future__ import annotations

import itertools

import torch
from torch import Generator, Tensor

from minedraft.sampling.params import SamplingParams
from minedraft.sampling.sampler import SparseProbs, draw_uniforms, sample_from, target_probs


def correction_distribution(p: Tensor, q: Tensor) -> Tensor:
    """What to sample from after rejecting a draft: max(0, p - q), unnormalised; p itself when that is
    all zero (p == q, where a rejection can only come from rounding)."""
    residual = (p - q).clamp_(min=0.0)
    return residual if bool(residual.sum() > 0) else p


def _verify_random(
    logits: Tensor, drafts: Tensor, q: SparseProbs, params: SamplingParams, generator: Generator | None
) -> list[int]:
    """One random request: ``logits`` [n+1, V], ``drafts`` [n], q with n rows."""
    n = drafts.shape[0]
    p = target_probs(logits, params)
    uniforms = draw_uniforms(generator, n + 1, logits.device)
    p_draft = p[torch.arange(n, device=p.device), drafts].double()
    # u < p/q, written without the division: q(d) = 0 (a draft q could not have produced) accepts
    # whenever p(d) > 0, and p >= q always accepts.
    accept = uniforms[:n] * q.prob_of(drafts).double() < p_draft
    rejected = (~accept).nonzero()
    accepted = int(rejected[0]) if rejected.numel() else n
    dist = correction_distribution(p[accepted], q[accepted].to_dense(p.shape[-1])[0]) if accepted < n else p[n]
    last = sample_from(dist[None], uniforms[n:])
    return drafts[:accepted].tolist() + [int(last)]


def _verify_greedy(argmax: list[int], drafts: list[int]) -> list[int]:
    """Accept while the draft is the target's argmax, then emit the argmax of the next row."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        accepted += 1
    return drafts[:accepted] + [argmax[accepted]]


def rejection_sample(
    target_logits: Tensor,
    draft_tokens: list[list[int]],
    draft_probs: list[SparseProbs | None],
    params_list: list[SamplingParams],
    generators: list[Generator | None],
) -> list[list[int]]:
    """Verify every request's drafts against the target.

    ``target_logits`` [sum(len(d_r) + 1), V]: request r's len(d_r) + 1 rows are consecutive, requests
    in order; row i of a request is the target distribution that verifies d_{i+1}, its last row gives
    the bonus token. ``draft_probs[r]`` is the sparse q each draft was sampled from (one row per
    draft); None means the drafts were chosen deterministically (q one-hot on each draft), and it is
    ignored for greedy requests and requests without drafts. Returns, per request, the accepted drafts
    followed by exactly one correction-or-bonus token.
    """
    counts = [len(d) + 1 for d in draft_tokens]
    if not len(draft_probs) == len(params_list) == len(generators) == len(draft_tokens):
        raise ValueError("draft_tokens, draft_probs, params_list and generators must have equal lengths")
    if sum(counts) != target_logits.shape[0]:
        raise ValueError(f"expected {sum(counts)} target logits rows, got {target_logits.shape[0]}")
    device = target_logits.device
    starts = [0, *itertools.accumulate(counts)][:-1]
    greedy_rows = [s + i for r, s in enumerate(starts) if params_list[r].greedy for i in range(counts[r])]
    argmax = iter(target_logits[greedy_rows].argmax(dim=-1).tolist() if greedy_rows else [])
    outputs = []
    for r, drafts in enumerate(draft_tokens):
        if params_list[r].greedy:
            outputs.append(_verify_greedy([next(argmax) for _ in range(counts[r])], list(drafts)))
            continue
        d = torch.tensor(drafts, dtype=torch.long, device=device)
        q = draft_probs[r] if draft_probs[r] is not None and drafts else SparseProbs.one_hot(d)
        if len(q) != len(drafts):
            raise ValueError(f"request {r}: {len(drafts)} drafts but {len(q)} draft distributions")
        logits = target_logits[starts[r] : starts[r] + counts[r]]
        outputs.append(_verify_random(logits, d, q.to(device), params_list[r], generators[r]))
    return outputs
