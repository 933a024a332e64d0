"""Lossless verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

For a random request, draft d_i (drawn from q_i) is accepted with probability min(1, p_i(d_i) / q_i(d_i));
at the first rejection the output is drawn from normalise(max(0, p_i - q_i)), and if every draft is
accepted a bonus token is drawn from p_{n+1}. Each emitted token is then distributed exactly as p,
the target's distribution under the request's own temperature/top-k/top-p. Greedy requests are the
same rule with p one-hot at the target's argmax and q one-hot at the draft: accept while the draft is
the argmax, then emit the argmax, which reproduces argmax decoding.

Randomness is keyed (``streams``): the acceptance test of the draft at output position x uses the
uniform ACCEPT(seed, x), and the token emitted at position x after the accepted drafts uses FINAL(seed,
x). So the result depends only on the request's seed, positions, logits and drafts, never on the batch
or on earlier calls. The whole batch is verified with tensor operations and one host transfer.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from minedraft.sampling.params import SamplingParams
from minedraft.sampling.sampler import SparseProbs, processed_prob_of, processed_probs, row_argmax, sample_from
from minedraft.sampling.streams import ACCEPT, FINAL, RowKeys


def correction_distribution(p: Tensor, q: Tensor) -> Tensor:
    """What to sample from after rejecting a draft, row by row: max(0, p - q), unnormalised; p itself
    where that is all zero (p == q, where a rejection can only come from rounding)."""
    residual = (p - q).clamp_(min=0.0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)


def _padded_drafts(
    draft_tokens: list[list[int]],
    draft_probs: list[SparseProbs | None],
    params_list: list[SamplingParams],
    width: int,
    device: torch.device,
) -> tuple[Tensor, Tensor, Tensor]:
    """Drafts [R, width] and their sparse q (ids, probs) [R, width, S], zero-padded, filled with one
    copy each. Deterministic drafts (q None) and greedy requests get q one-hot on each draft."""
    tokens = torch.tensor([d + [0] * (width - len(d)) for d in draft_tokens], dtype=torch.long, device=device)
    qs = [_q_of(r, d, q, p, tokens) for r, (d, q, p) in enumerate(zip(draft_tokens, draft_probs, params_list))]
    support = max((q.support_size for q in qs if q is not None), default=1)
    ids = torch.zeros(len(draft_tokens) * width, support, dtype=torch.long, device=device)
    probs = torch.zeros(len(draft_tokens) * width, support, device=device)
    present = [(r, q) for r, q in enumerate(qs) if q is not None]
    if present:
        rows = torch.cat([torch.arange(len(q), device=device) + r * width for r, q in present])
        pad = lambda t: torch.nn.functional.pad(t.to(device), (0, support - t.shape[1]))  # noqa: E731
        ids[rows] = torch.cat([pad(q.token_ids) for _, q in present])
        probs[rows] = torch.cat([pad(q.probs.float()) for _, q in present])
    return tokens, ids.view(len(draft_tokens), width, support), probs.view(len(draft_tokens), width, support)


def _q_of(
    r: int, drafts: list[int], q: SparseProbs | None, params: SamplingParams, tokens: Tensor
) -> SparseProbs | None:
    """Request r's draft distributions, one row per draft (None without drafts)."""
    if not drafts:
        return None
    if q is None or params.greedy:
        return SparseProbs.one_hot(tokens[r, : len(drafts)])
    if len(q) != len(drafts):
        raise ValueError(f"request {r}: {len(drafts)} drafts but {len(q)} draft distributions")
    return q


def _check_shapes(
    target_logits: Tensor, draft_tokens: list, draft_probs: list, params_list: list, keys: RowKeys
) -> list[int]:
    counts = [len(d) + 1 for d in draft_tokens]
    if not len(draft_probs) == len(params_list) == len(keys) == len(draft_tokens):
        raise ValueError("draft_tokens, draft_probs, params_list and keys must have equal lengths")
    if sum(counts) != target_logits.shape[0]:
        raise ValueError(f"expected {sum(counts)} target logits rows, got {target_logits.shape[0]}")
    return counts


def rejection_sample(
    target_logits: Tensor,
    draft_tokens: list[list[int]],
    draft_probs: list[SparseProbs | None],
    params_list: list[SamplingParams],
    keys: RowKeys,
) -> list[list[int]]:
    """Verify every request's drafts against the target.

    ``target_logits`` [sum(len(d_r) + 1), V]: request r's len(d_r) + 1 rows are consecutive, requests
    in order; row i of a request is the target distribution that verifies d_{i+1}, its last row gives
    the bonus token. ``draft_probs[r]`` is the sparse q each draft was sampled from (one row per
    draft); None means the drafts were chosen deterministically (q one-hot on each draft), and it is
    ignored for greedy requests and requests without drafts. ``keys`` row r: request r's seed and the
    output position of its first row. Returns, per request, the accepted drafts followed by exactly
    one correction-or-bonus token.
    """
    counts = _check_shapes(target_logits, draft_tokens, draft_probs, params_list, keys)
    if all(params.greedy for params in params_list):
        return _greedy_verify(target_logits, draft_tokens, counts)
    device, width = target_logits.device, max(counts) - 1
    starts = torch.tensor([0, *itertools.accumulate(counts)][:-1], device=device)
    num_drafts = torch.tensor(counts, device=device) - 1
    offsets = torch.arange(width + 1, device=device)
    rows = starts[:, None] + torch.minimum(offsets[None, :], num_drafts[:, None])  # [R, width + 1]
    drafts, q_ids, q_probs = _padded_drafts(draft_tokens, draft_probs, params_list, width, device)
    # u < p/q, written without the division: q(d) = 0 (a draft q could not have produced) accepts
    # whenever p(d) > 0, and p >= q always accepts.
    p_draft = _draft_target_probs(target_logits, rows[:, :width], draft_tokens, params_list)
    q_draft = (q_probs * (q_ids == drafts[..., None])).sum(dim=-1).double()
    accept = keys.draw(ACCEPT, device, offsets[:width]) * q_draft < p_draft
    accept &= offsets[None, :width] < num_drafts[:, None]
    accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading accepts
    final_rows, uniforms = rows.gather(1, accepted[:, None]).squeeze(1), _final_uniforms(keys, accepted)
    last = torch.cat(
        [
            sample_from(
                _final_distribution(
                    processed_probs(target_logits[final_rows[b]], params_list[b]),
                    accepted[b], num_drafts[b], q_ids[b], q_probs[b],
                ),
                uniforms[b],
            )
            for b in row_blocks(len(params_list), target_logits)
        ]
    )  # fmt: skip
    accepted_list, last_list = accepted.tolist(), last.tolist()
    return [d[:a] + [t] for d, a, t in zip(draft_tokens, accepted_list, last_list)]


def _greedy_verify(target_logits: Tensor, draft_tokens: list[list[int]], counts: list[int]) -> list[list[int]]:
    """The rule above when every request is greedy (p one-hot at the argmax, q one-hot at each draft): accept
    drafts while each is its row's argmax, then emit the argmax of the next row. The same tokens as the
    general path, from one argmax and one host transfer; plain decoding takes this path on every step."""
    argmax = row_argmax(target_logits).tolist()  # the first index among equal maxima, as processed_probs
    out, start = [], 0
    for drafts, count in zip(draft_tokens, counts):
        best = argmax[start : start + count]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == best[accepted]:
            accepted += 1
        out.append(drafts[:accepted] + [best[accepted]])
        start += count
    return out


def _draft_target_probs(
    target_logits: Tensor, rows: Tensor, draft_tokens: list[list[int]], params_list: list[SamplingParams]
) -> Tensor:
    """p(d) [R, width] float64 at every draft (``rows``: each draft's target logits row). Computed on
    every logits row, each request's bonus row too (token 0 there, unused): no copy of the logits."""
    tokens = torch.tensor([t for d in draft_tokens for t in (*d, 0)], dtype=torch.long, device=rows.device)
    row_params = [params for params, d in zip(params_list, draft_tokens) for _ in range(len(d) + 1)]
    return processed_prob_of(target_logits, tokens, row_params).double()[rows]


def _final_distribution(
    p_final: Tensor, accepted: Tensor, num_drafts: Tensor, q_ids: Tensor, q_probs: Tensor
) -> Tensor:
    """Per request [R, V]: the residual at the first rejected draft, or p (``p_final``: the target's
    processed row there) at the bonus row. Requests that rejected nothing get q = 0, whose residual is p."""
    if q_ids.shape[1] == 0:
        return p_final
    at = accepted.clamp(max=q_ids.shape[1] - 1)[:, None, None].expand(-1, 1, q_ids.shape[2])
    rejected = (accepted < num_drafts).float()[:, None]
    q_dense = torch.zeros_like(p_final).scatter_add_(
        1, q_ids.gather(1, at)[:, 0], q_probs.gather(1, at)[:, 0] * rejected
    )
    return correction_distribution(p_final, q_dense)


def row_blocks(rows: int, like: Tensor) -> list[slice]:
    """Row ranges to process [rows, V] work in: on CPU about 1 MiB of float32 each, so that the several
    passes over a block run in cache; elsewhere one block (batching is what a GPU wants)."""
    block = max(1, (1 << 18) // like.shape[-1]) if like.device.type == "cpu" else max(rows, 1)
    return [slice(i, i + block) for i in range(0, rows, block)]


def _final_uniforms(keys: RowKeys, accepted: Tensor) -> Tensor:
    """FINAL(seed, position of the emitted token) per request."""
    shifted = RowKeys(keys.seeds, keys.positions.to(accepted.device) + accepted, keys.counters)
    return shifted.draw(FINAL, accepted.device)
