"""Causal attention of each sequence's new tokens over its cache slot, bottom-right aligned.

Query i of a sequence sits at position start + i and sees keys 0 .. start + i. Two kernels:

* ``sdpa``: torch scaled_dot_product_attention per sequence (fast; used on CUDA).
* ``batch-invariant``: the same math with every GEMM and reduction at a fixed shape (Q_BLOCK query rows
  x KV_BLOCK keys, blocks combined sequentially), so a token's output is bit-identical whether it is
  decoded alone, verified among k drafts or batched with other sequences. Fully masked blocks contribute
  exact zeros, which is what makes the longer key range of a verification pass harmless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minedraft.model.kv_cache import KV_BLOCK

Q_BLOCK = 8  # query rows per fixed-shape block
_MAX_SCORES = 1 << 22  # score elements per chunk of query blocks, to bound memory on long prefills


@dataclass
class SeqAttention:
    """Per-sequence attention inputs, built once per forward and shared by all layers."""

    slot: int
    start: int  # tokens already in the cache before this pass
    offset: int  # index of the sequence's first token in the flattened batch
    length: int  # new tokens of this sequence
    mask: torch.Tensor | None  # boolean; None where every key is visible (sdpa decode)


def build_seq_attention(slots: list[int], starts: list[int], lengths: list[int], device: torch.device,
                        batch_invariant: bool) -> list[SeqAttention]:
    seqs, offset = [], 0
    for slot, start, length in zip(slots, starts, lengths, strict=True):
        mask = _block_mask(start, length, device) if batch_invariant else _sdpa_mask(start, length, device)
        seqs.append(SeqAttention(slot, start, offset, length, mask))
        offset += length
    return seqs


def _sdpa_mask(start: int, length: int, device: torch.device) -> torch.Tensor | None:
    if length == 1:
        return None
    return torch.ones(length, start + length, dtype=torch.bool, device=device).tril(diagonal=start)


def _block_mask(start: int, length: int, device: torch.device) -> torch.Tensor:
    """[q_blocks, kv_blocks, Q_BLOCK, KV_BLOCK] visibility; padding rows repeat the last position."""
    num_q = -(-length // Q_BLOCK)
    num_kv = -(-(start + length) // KV_BLOCK)
    pos = torch.arange(num_q * Q_BLOCK, device=device).clamp(max=length - 1) + start
    keys = torch.arange(num_kv * KV_BLOCK, device=device).view(num_kv, KV_BLOCK)
    return keys[None, :, None, :] <= pos.view(num_q, 1, Q_BLOCK, 1)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: SeqAttention, scale: float,
           batch_invariant: bool) -> torch.Tensor:
    """q: [length, heads, head_dim] of one sequence; caches: [slots, kv_heads, max_len, head_dim]."""
    k, v = k_cache[seq.slot], v_cache[seq.slot]
    if batch_invariant:
        return _invariant_attention(q, k, v, seq, scale)
    end = seq.start + seq.length
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k[:, :end], v[:, :end], attn_mask=seq.mask,
                                         scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def _invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqAttention,
                         scale: float) -> torch.Tensor:
    length, heads, dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    num_q, num_kv = seq.mask.shape[0], seq.mask.shape[1]
    rows = group * Q_BLOCK
    # [kv_heads, q_blocks, 1, group * Q_BLOCK, dim]: GQA query heads of one kv head share a GEMM.
    qb = F.pad(q, (0, 0, 0, 0, 0, num_q * Q_BLOCK - length)).view(num_q, Q_BLOCK, kv_heads, group, dim)
    qb = qb.permute(2, 0, 3, 1, 4).reshape(kv_heads, num_q, 1, rows, dim)
    kb = k[:, : num_kv * KV_BLOCK].reshape(kv_heads, 1, num_kv, KV_BLOCK, dim)
    vb = v[:, : num_kv * KV_BLOCK].reshape(kv_heads, 1, num_kv, KV_BLOCK, dim)
    step = max(1, _MAX_SCORES // (heads * Q_BLOCK * num_kv * KV_BLOCK))
    outs = [
        _attend_q_blocks(qb[:, i : i + step], kb, vb, seq.mask[i : i + step], scale, group)
        for i in range(0, num_q, step)
    ]
    out = torch.cat(outs, dim=1).view(kv_heads, num_q, group, Q_BLOCK, dim)
    return out.permute(1, 3, 0, 2, 4).reshape(num_q * Q_BLOCK, heads, dim)[:length]


def _attend_q_blocks(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, mask: torch.Tensor, scale: float,
                     group: int) -> torch.Tensor:
    kv_heads, num_q, _, rows, dim = qb.shape
    num_kv = kb.shape[2]
    scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # [kv_heads, q, kv, rows, KV_BLOCK]
    scores = scores.view(kv_heads, num_q, num_kv, group, Q_BLOCK, KV_BLOCK)
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.exp(scores - scores.amax(dim=(2, 5), keepdim=True))  # row max is exact in any order
    # cumsum runs strictly left to right over kv blocks, so trailing all-zero blocks change nothing.
    denom = probs.sum(-1).cumsum(2)[:, :, -1]  # [kv_heads, q, group, Q_BLOCK]
    out = torch.matmul(probs.view(kv_heads, num_q, num_kv, rows, KV_BLOCK), vb).cumsum(2)[:, :, -1]
    return out.view(kv_heads, num_q, group, Q_BLOCK, dim) / denom.unsqueeze(-1)
