"""Turning logits into tokens: the request's logits processing, plain sampling and draft sampling.

Every random draw is a float64 uniform that the caller passes in, one per row; the workers key them by
the request's seed and output position (``streams``), so a request gives the same tokens whatever else
is in the batch and whatever ran before (a re-admitted request draws what it would have drawn).

Top-k and top-p follow vLLM/HF: temperature first (on logits the request's penalties and biases have
already changed, ``penalties``), then min_p drops the tokens whose probability is below min_p x the
largest, then top-k on the scaled logits, then top-p keeps the smallest prefix of the sorted
probabilities whose mass reaches ``top_p`` (at least one token).
Ties: every token whose logit equals the last kept one is kept, for top-k (as vLLM and HF do) and for
top-p (where vLLM and HF cut inside a run of equal values by sort position). So the result never
depends on how a sort (CPU or CUDA, stable or not) orders equal values.
Only a row's largest logits are sorted where its cut lies among them (a top-k far below the vocabulary, a
top-p whose mass they reach): the rest of the row drops whole, and the kept set is what a full sort keeps.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from minedraft.sampling.params import SamplingParams


def row_argmax(logits: Tensor) -> Tensor:
    """Each row's argmax [rows] int64: the first index among equal maxima, a NaN counting as the largest (as
    torch's). On CPU through numpy, whose argmax is vectorised: torch's took ~10 us a vocabulary row of 4,096
    (208 us for a verification of 8 windows of 5), numpy's 13 us for those 40 rows."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64):
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False))


def sample_from(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF sampling: one index per row of ``probs`` [r, K] (unnormalised is fine), given one
    uniform per row. The float64 CDF keeps tiny probabilities samplable, and a flat CDF step (p = 0)
    is never chosen."""
    cdf = probs.double().cumsum(dim=-1)
    target = uniforms.to(cdf.device) * cdf[:, -1]
    index = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    return index.clamp_(max=probs.shape[-1] - 1)


def _filter(logits: Tensor, min_p: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (to -inf) what min_p, then top-k, then top-p drop.

    ``min_p`` [r] float32 (0 turns it off), ``top_k`` [r] int64 (>= vocab turns it off), ``top_p`` [r]
    float64 (1 turns it off)."""
    probs = logits.softmax(dim=-1)
    logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    threshold, found = _threshold_among_candidates(logits, top_k, top_p)
    rest = (~found).nonzero().squeeze(1)
    if len(rest):  # the rows whose cut may lie beyond their candidates: every logit sorted, as in HF/vLLM
        threshold[rest] = _threshold(logits[rest].sort(dim=-1).values, top_k[rest], top_p[rest])
    return logits.masked_fill(logits < threshold, float("-inf"))


def _threshold(ordered: Tensor, top_k: Tensor, top_p: Tensor, outside: Tensor | None = None) -> Tensor:
    """Each row's smallest kept logit [r, 1], from its logits in ascending order: all of them, or only its
    largest, with `outside` the probability of the rest (0 where top-k drops them all), which top-p drops."""
    width = ordered.shape[-1]
    # Top-k: the k-th largest logit is the threshold; ties with it survive.
    kth = ordered.gather(1, (width - top_k.clamp(1, width))[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    # Top-p: drop the longest run of smallest tokens whose mass is <= 1 - top_p (what remains has mass
    # >= top_p). Summing from the small end keeps the tail's mass accurate, so top_p = 1 drops nothing
    # with non-zero probability; the sum is monotone, so the dropped positions form a prefix.
    if outside is None:
        mass = ordered.softmax(dim=-1).cumsum(dim=-1)
    else:
        total = ordered.logsumexp(dim=-1) - torch.log1p(-outside)  # the whole row's, from the candidates' share
        mass = outside[:, None] + (ordered - total[:, None]).exp().cumsum(dim=-1)
    dropped = (mass <= (1.0 - top_p).float()[:, None]).sum(dim=1).clamp_(max=width - 1)  # keep the largest
    return ordered.gather(1, dropped[:, None])


# How many of a row's largest logits a top-p without a top-k starts from: its cut mostly falls among them.
_TOP_P_CANDIDATES = 128


def _threshold_among_candidates(logits: Tensor, top_k: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """`_threshold` [r, 1] from each row's largest logits only (a partial top-k is one pass over a row, where a
    full sort of a large vocabulary costs many), and [r] whether it holds: not where a row's cut could fall
    outside them (a top-k whose k-th value has ties further out, a top-p whose mass they do not reach, a wide
    top-k), nor where the vocabulary is too small for the candidates to pay."""
    vocab, rows = logits.shape[-1], logits.shape[0]
    narrow = top_k < vocab // 8
    width = max(int(top_k[narrow].max()) + 1 if bool(narrow.any()) else 0,  # + 1 shows where ties reach
                _TOP_P_CANDIDATES if not bool(narrow.all()) else 0)  # fmt: skip
    if width * 8 > vocab:
        return logits.new_empty(rows, 1), torch.zeros(rows, dtype=torch.bool, device=logits.device)
    largest = logits.topk(width, dim=-1).values  # descending
    kth = largest.gather(1, (top_k.clamp(1, width) - 1)[:, None]).squeeze(1)
    full = logits.logsumexp(dim=-1)
    outside = torch.where(narrow, 0.0, (1.0 - (largest - full[:, None]).exp().sum(dim=-1)).clamp(min=0.0))
    found = torch.where(
        narrow,
        largest[:, -1] < kth,  # no tie of the k-th value left outside
        # no top-k, and the rest's mass small enough (with room for rounding) for top-p to drop it whole
        (top_k >= vocab) & (outside.double() + 1e-5 < 1.0 - top_p),
    )
    return _threshold(largest.flip(-1), top_k, top_p, outside), found


def _uses_filter(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def processed_probs(logits: Tensor, params_list: Sequence[SamplingParams]) -> Tensor:
    """Probabilities [m, V] after each row's temperature, min_p, top-k and top-p; greedy rows are one-hot
    at the argmax of the logits (first index among equal maxima). Penalties and biases are the caller's to
    apply first (``penalties.apply_penalties``)."""
    logits = logits.float()
    device, rows = logits.device, len(params_list)
    if rows != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows but {rows} sampling params")
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params_list], device=device)
    scaled = logits / temps[:, None]
    filtered = [i for i, p in enumerate(params_list) if _uses_filter(p) and not p.greedy]
    if filtered:
        index = torch.tensor(filtered, device=device)
        vocab = logits.shape[-1]
        top_k = torch.tensor([params_list[i].top_k if params_list[i].top_k > 0 else vocab for i in filtered])
        top_p = torch.tensor([params_list[i].top_p for i in filtered], dtype=torch.float64)
        min_p = torch.tensor([params_list[i].min_p for i in filtered])
        scaled[index] = _filter(scaled[index], min_p.to(device), top_k.to(device), top_p.to(device))
    probs = scaled.softmax(dim=-1)
    greedy = [i for i, p in enumerate(params_list) if p.greedy]
    if greedy:
        index = torch.tensor(greedy, device=device)
        hot = torch.zeros(len(greedy), logits.shape[-1], device=device)
        probs[index] = hot.scatter_(1, row_argmax(logits[index])[:, None], 1.0)
    return probs


def processed_prob_of(logits: Tensor, tokens: Tensor, params_list: Sequence[SamplingParams]) -> Tensor:
    """p_i(tokens[i]) [m] float32 for each row of ``logits`` [m, V]: ``processed_probs(...)[i, tokens[i]]``
    up to rounding, without the whole distribution's extra passes where no top-k/top-p asks for it
    (one fused log-softmax; greedy rows: 1 at the argmax, else 0)."""
    logits, device = logits.float(), logits.device
    out = torch.zeros(len(params_list), device=device)
    tokens = tokens.to(device)
    groups = {"plain": [], "greedy": [], "filtered": []}
    for i, p in enumerate(params_list):
        groups["greedy" if p.greedy else "filtered" if _uses_filter(p) else "plain"].append(i)
    if groups["plain"]:
        index = torch.tensor(groups["plain"], device=device)
        temps = torch.tensor([params_list[i].temperature for i in groups["plain"]], device=device)[:, None]
        rows = logits if len(index) == len(params_list) else logits[index]  # no copy when all rows are plain
        out[index] = _log_softmax_at(rows, temps, tokens[index]).exp()
    if groups["greedy"]:
        index = torch.tensor(groups["greedy"], device=device)
        out[index] = (row_argmax(logits[index]) == tokens[index]).float()
    if groups["filtered"]:
        index = torch.tensor(groups["filtered"], device=device)
        probs = processed_probs(logits[index], [params_list[i] for i in groups["filtered"]])
        out[index] = probs.gather(1, tokens[index, None]).squeeze(1)
    return out


def _log_softmax_at(logits: Tensor, temps: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits / temps)[tokens], row by row. On CPU in blocks of about 1 MiB, so that each
    block's passes run in cache instead of streaming the whole batch from memory several times."""
    block = max(1, (1 << 18) // logits.shape[-1]) if logits.device.type == "cpu" else logits.shape[0]
    parts = [
        (logits[i : i + block] / temps[i : i + block]).log_softmax(dim=-1).gather(1, tokens[i : i + block, None])
        for i in range(0, logits.shape[0], block)
    ]
    return torch.cat(parts).squeeze(1)


def _check_batch(logits: Tensor, params_list: Sequence[SamplingParams], uniforms: Tensor) -> None:
    if not logits.shape[0] == len(params_list) == uniforms.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows, {len(params_list)} params, {uniforms.shape[0]} uniforms")


@dataclass
class SparseProbs:
    """Draft distributions over their top-S support, one row per draft token.

    ``token_ids`` [n, S] int64 and ``probs`` [n, S] float32; each row sums to 1. Padding entries have
    probability 0 and an arbitrary valid id, which may repeat another id of the row (so densify by
    adding, never by assigning).
    """

    token_ids: Tensor
    probs: Tensor

    def __post_init__(self) -> None:
        if self.token_ids.shape != self.probs.shape or self.token_ids.dim() != 2:
            raise ValueError(f"need matching [n, S] tensors, got {self.token_ids.shape}, {self.probs.shape}")

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    def __getitem__(self, rows: int | slice | Tensor | list[int]) -> SparseProbs:
        """Rows as a new SparseProbs (an int keeps its row dimension)."""
        if isinstance(rows, int):
            rows = slice(rows, rows + 1 if rows != -1 else None)
        return SparseProbs(self.token_ids[rows], self.probs[rows])

    @property
    def support_size(self) -> int:
        return self.token_ids.shape[1]

    @property
    def device(self) -> torch.device:
        return self.probs.device

    def to(self, device: torch.device | str) -> SparseProbs:
        return SparseProbs(self.token_ids.to(device), self.probs.to(device))

    @staticmethod
    def cat(parts: Sequence[SparseProbs]) -> SparseProbs:
        """Rows of all ``parts`` in order (same support size)."""
        return SparseProbs(torch.cat([p.token_ids for p in parts]), torch.cat([p.probs for p in parts]))

    @staticmethod
    def one_hot(token_ids: Tensor) -> SparseProbs:
        """Deterministic proposals: all mass on ``token_ids`` [n], support size 1."""
        ids = token_ids.reshape(-1, 1).long()
        return SparseProbs(ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device))


def draft_sample(
    logits: Tensor,
    params_list: list[SamplingParams],
    uniforms: Tensor,
    support_size: int,
) -> tuple[list[int], list[float], SparseProbs]:
    """One draft token per row of ``logits`` [B, V].

    Random row i samples, with ``uniforms[i]``, from q = the request's processed distribution truncated to its top
    ``support_size`` tokens and renormalised, so q can travel sparsely; the returned probability is
    q(chosen) under that q. Greedy rows take the argmax; their probability is softmax(logits)[argmax]
    (the drafter's confidence, for Tetris) and their q is one-hot on the argmax. The returned
    SparseProbs always has exactly ``support_size`` columns (padded with probability 0 when the
    vocabulary is smaller).
    """
    _check_batch(logits, params_list, uniforms)
    if support_size < 1:
        raise ValueError("support_size must be >= 1")
    batch, vocab = logits.shape
    device = logits.device
    width = min(support_size, vocab)
    argmax = row_argmax(logits)
    if all(p.greedy for p in params_list):  # the common draft step: no row index nor gather (44 against 128 us)
        confidence = logits.float().softmax(dim=-1).amax(dim=-1)
        return argmax.tolist(), confidence.tolist(), greedy_layout(argmax, support_size)
    token_probs = torch.zeros(batch, device=device)
    greedy = [i for i, p in enumerate(params_list) if p.greedy]
    if greedy:
        index = torch.tensor(greedy, device=device)
        token_probs[index] = logits[index].float().softmax(dim=-1).amax(dim=-1)  # = softmax at the argmax
    layout = greedy_layout(argmax, support_size)  # copied below: the random rows are written into it
    ids, probs = layout.token_ids.clone(), layout.probs.clone()
    tokens = argmax.clone()
    rows = [i for i, p in enumerate(params_list) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=device)
        top = processed_probs(logits[index], [params_list[i] for i in rows]).topk(width, dim=-1)
        q = top.values / top.values.sum(dim=-1, keepdim=True)
        pick = sample_from(q, uniforms.to(device)[index])[:, None]
        tokens[index] = top.indices.gather(1, pick).squeeze(1)
        token_probs[index] = q.gather(1, pick).squeeze(1)
        ids[index, :width] = top.indices
        probs[index] = torch.nn.functional.pad(q, (0, support_size - width))
    return tokens.tolist(), token_probs.tolist(), SparseProbs(ids, probs)


def greedy_layout(argmax: Tensor, support_size: int) -> SparseProbs:
    """Greedy rows' layout, the argmax in column 0 with all the mass (the rest is padding), as views that copy
    nothing: each row's ids repeat its argmax, and every row's probabilities are one shared row (1, 0, ...).
    Read-only: writing into an expanded view raises."""
    row = _first_column(support_size, argmax.device)
    return SparseProbs(argmax[:, None].expand(-1, support_size), row.expand(argmax.shape[0], -1))


@functools.lru_cache(maxsize=8)
def _first_column(support_size: int, device: torch.device) -> Tensor:
    """[1, support_size]: all the mass in column 0 (shared, never written: callers see it expanded)."""
    row = torch.zeros(1, support_size, device=device)
    row[0, 0] = 1.0
    return row
