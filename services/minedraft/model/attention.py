"""Causal attention of each sequence's new tokens over its paged KV cache, bottom-right aligned.

Query i of a sequence sits at position start + i and sees keys 0 .. start + i. For the torch kernels a
sequence's keys are gathered from the pool through its block table (one index_select per layer and kernel
call; padding entries point at the zero block), except where the sdpa kernel reads one sequence whose blocks
lie in one run of the pool: then it reads a view of the pool and copies nothing (the usual case at one
request in flight, where the copy was a sixth of a decode step on 600-token contexts). The C kernel reads
every sequence's blocks in place. Three kernels on CPU (the GPU's paged Triton kernel: triton_attention.py):

* ``sdpa`` (the default): torch scaled_dot_product_attention. Sequences with short queries (decode
  steps, k + 1 verification tokens, draft steps) share one call per layer over their gathered keys,
  queries padded to the longest, a mask hiding what each query may not see. Long queries (prefill) get
  a call each, so one long prompt never pads the whole batch.
* ``cpu`` (the CPU default for float32 models, where the machine's C compiler builds it): short queries
  go to a C kernel that reads each sequence's blocks in place (model/kernels/cpu_attention.py); long queries keep
  sdpa's calls.
* ``batch-invariant``: the same math with every GEMM and reduction at a fixed shape (Q_BLOCK query rows
  x KV_BLOCK keys, key blocks combined strictly left to right), so a token's output is bit-identical
  whether it is decoded alone, verified among k drafts or batched with other sequences. Blocks a row
  may not see contribute exact zeros, which makes padding to a longer key range harmless. Sequences
  are batched into groups of equal query-block count, so a decode step is a handful of ops per layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from minedraft.model.kernels.cpu_attention import CpuPagedMeta, cpu_paged_meta
from minedraft.model.kernels.cpu_attention import paged_attention as cpu_paged_attention
from minedraft.model.kv_cache import NULL_BLOCK

Q_BLOCK = 8  # query rows per fixed-shape block
KV_BLOCK = 64  # keys per fixed-shape block (independent of the cache's block size)
PADDED_MAX_QUERY = 32  # sdpa: queries up to this length share the padded batched call
_MAX_SCORES = 1 << 22  # score elements per group, to bound memory on long prefills


@dataclass
class SeqAttention:
    """One sequence, for the sdpa kernel."""

    blocks: torch.Tensor  # [blocks] the cache blocks holding its keys, in order
    start: int  # tokens already in the cache before this pass
    offset: int  # index of the sequence's first token in the flattened batch
    length: int  # new tokens of this sequence
    mask: torch.Tensor | None  # [length, start + length]; None: a single token (sees all) or a fresh prompt (causal)
    run: int | None = None  # first block, when its blocks are one run of the pool (read as a view)


@dataclass
class PaddedGroup:
    """Sequences with short queries, for one batched sdpa call over their gathered keys.

    Queries are padded to the longest (padding rows repeat a real token); key rows past a sequence's end
    come from the zero block and are masked.
    """

    tables: torch.Tensor  # [seqs, blocks] block table of each sequence, padded with the zero block
    rows: torch.Tensor  # [seqs, max_query] token index of each query row in the flattened batch
    mask: torch.Tensor | None  # [seqs, 1, group * max_query, keys] key visibility; None: all visible
    keys: int  # cache positions read per sequence: the longest sequence's
    src: torch.Tensor | None  # indices of real rows in the flattened [seqs * max_query] output;
    dst: torch.Tensor | None  # their token indices in the batch (both None: output is the batch as is)
    run: int | None = None  # one sequence whose blocks are one run of the pool: its first block


@dataclass
class BlockGroup:
    """Pieces of sequences with the same number of query blocks, for the batch-invariant kernel."""

    tables: torch.Tensor  # [pieces, blocks] block table of each piece's sequence, padded with the zero block
    rows: torch.Tensor  # [pieces, q_blocks * Q_BLOCK] token index of each query row (padding repeats one)
    mask: torch.Tensor  # [pieces, q_blocks, kv_blocks, Q_BLOCK, KV_BLOCK] key visibility
    src: torch.Tensor  # indices of real (non-padding) rows in the flattened output
    dst: torch.Tensor  # their token indices in the batch


@dataclass
class AttentionPlan:
    seqs: list[SeqAttention]  # sdpa, one call each
    groups: list[BlockGroup]  # batch-invariant
    padded: PaddedGroup | None = None  # sdpa, one call for all
    paged: Any = None  # triton_attention.PagedMeta: the whole batch in one paged kernel call
    cpu: CpuPagedMeta | None = None  # the short queries in one call of the C kernel
    cpu_covers_all: bool = False  # every token of the batch is one of them


def plan_attention(starts: list[int], lengths: list[int], tables: list[list[int]], block_size: int,
                   num_heads: int, num_kv_heads: int, device: torch.device, batch_invariant: bool,
                   paged_kernel: bool = False, cpu_kernel: bool = False) -> AttentionPlan:
    """Host-side bookkeeping shared by all layers of one forward pass."""
    if paged_kernel:
        from minedraft.model.kernels.triton_attention import paged_meta  # triton is imported only where it runs

        return AttentionPlan([], [], paged=paged_meta(starts, lengths, tables, NULL_BLOCK, device))
    offsets = [0, *itertools.accumulate(lengths)][:-1]
    if not batch_invariant:
        short = [i for i, n in enumerate(lengths) if n <= PADDED_MAX_QUERY]
        seqs = [SeqAttention(_table_tensor([tables[i]], starts[i] + lengths[i], block_size, device)[0], starts[i],
                             offsets[i], lengths[i], _sdpa_mask(starts[i], lengths[i], device),
                             _run(tables[i], starts[i] + lengths[i], block_size))
                for i in range(len(lengths)) if lengths[i] > PADDED_MAX_QUERY]
        if cpu_kernel and short:
            meta = cpu_paged_meta([starts[i] for i in short], [offsets[i] for i in short],
                                  [lengths[i] for i in short], [tables[i] for i in short], NULL_BLOCK)
            return AttentionPlan(seqs, [], cpu=meta, cpu_covers_all=len(short) == len(lengths))
        padded = _padded_group([tables[i] for i in short], block_size, [starts[i] for i in short],
                               [offsets[i] for i in short], [lengths[i] for i in short], sum(lengths),
                               num_heads // num_kv_heads, device) if short else None
        return AttentionPlan(seqs, [], padded)
    pieces = [p for s in zip(tables, starts, offsets, lengths, strict=True) for p in _pieces(*s, num_heads)]
    by_blocks: dict[int, list[_Piece]] = {}
    for piece in pieces:
        by_blocks.setdefault(piece.q_blocks, []).append(piece)
    groups = [_build_group(chunk, block_size, device) for same in by_blocks.values()
              for chunk in _chunks(same, num_heads)]
    return AttentionPlan([], groups)


def _table_tensor(tables: list[list[int]], keys: int, block_size: int, device: torch.device) -> torch.Tensor:
    """[seqs, ceil(keys / block_size)] block tables cut or padded (with the zero block) to cover `keys`."""
    width = -(-keys // block_size)
    rows = [table[:width] + [NULL_BLOCK] * (width - len(table)) for table in tables]
    return torch.tensor(rows, dtype=torch.int64).to(device)


def _run(table: list[int], keys: int, block_size: int) -> int | None:
    """The first block of the table's first `keys` positions when they lie in consecutive blocks, else None."""
    width = -(-keys // block_size)
    first = table[0]
    return first if table[:width] == list(range(first, first + width)) else None


def run_keys(cache: torch.Tensor, run: int, keys: int) -> torch.Tensor:
    """[1, kv_heads, keys, head_dim]: a view of `keys` positions held in consecutive blocks from `run` on."""
    kv_heads, _, block_size, dim = cache.shape
    width = -(-keys // block_size)
    return cache[:, run : run + width].reshape(kv_heads, width * block_size, dim)[None, :, :keys]


def gather_keys(cache: torch.Tensor, tables: torch.Tensor, keys: int) -> torch.Tensor:
    """[seqs, kv_heads, keys, head_dim] of a [kv_heads, blocks, block_size, head_dim] pool."""
    kv_heads, _, block_size, dim = cache.shape
    seqs, width = tables.shape
    index = tables.flatten()
    if cache.device.type == "cpu":
        # Per head along the leading dimension: whole [block_size, dim] rows, copied on every thread (one
        # index_select along dimension 1 copies on one thread: 2.2x slower on two cores, at 32 sequences
        # a quarter of a decode step).
        gathered = cache.new_empty(kv_heads, seqs * width, block_size, dim)
        for head in range(kv_heads):
            torch.index_select(cache[head], 0, index, out=gathered[head])
    else:
        gathered = cache.index_select(1, index)
    gathered = gathered.view(kv_heads, seqs, width * block_size, dim)
    return gathered.transpose(0, 1)[:, :, :keys]


def _padded_group(tables: list[list[int]], block_size: int, starts: list[int], offsets: list[int],
                  lengths: list[int], tokens: int, group_size: int, device: torch.device) -> PaddedGroup:
    if lengths == [1]:  # one decoding sequence: it sees all its keys, nothing is padded
        keys, alone = starts[0] + 1, tokens == 1
        return PaddedGroup(tables=_table_tensor(tables, keys, block_size, device),
                           rows=torch.tensor([offsets], device=device), mask=None, keys=keys,
                           src=None if alone else torch.tensor([0], device=device),
                           dst=None if alone else torch.tensor(offsets, device=device),
                           run=_run(tables[0], keys, block_size))
    lens = torch.tensor(lengths)[:, None]
    query = torch.arange(max(lengths))
    index = torch.minimum(query, lens - 1)  # padding rows act as the sequence's last token
    rows = torch.tensor(offsets)[:, None] + index
    positions = torch.tensor(starts)[:, None] + index
    keys = int(positions.max()) + 1
    mask = torch.arange(keys) <= positions[:, :, None]
    mask = mask.repeat(1, group_size, 1)  # query rows are (head in the kv group, query), see _padded_sdpa
    real = query < lens
    as_is = bool(real.all()) and rows.numel() == tokens  # no padding and every token in order
    return PaddedGroup(
        tables=_table_tensor(tables, keys, block_size, device),
        rows=rows.to(device),
        mask=None if bool(mask.all()) else mask[:, None].to(device),
        keys=keys,
        src=None if as_is else real.flatten().nonzero().squeeze(1).to(device),
        dst=None if as_is else rows[real].to(device),
        run=_run(tables[0], keys, block_size) if len(tables) == 1 else None,
    )


def _sdpa_mask(start: int, length: int, device: torch.device) -> torch.Tensor | None:
    if length == 1 or start == 0:  # sdpa's own causal mask (is_causal) skips the blocks no query sees
        return None
    return torch.ones(length, start + length, dtype=torch.bool, device=device).tril(diagonal=start)


@dataclass
class _Piece:
    table: list[int]
    start: int  # cache position of the sequence's first new token
    offset: int  # its token index in the batch
    length: int  # new tokens of the sequence
    first_block: int  # query blocks [first_block, first_block + q_blocks) of the sequence
    q_blocks: int

    @property
    def kv_blocks(self) -> int:
        last_row = min(self.length, (self.first_block + self.q_blocks) * Q_BLOCK) - 1
        return -(-(self.start + last_row + 1) // KV_BLOCK)


def _pieces(table: list[int], start: int, offset: int, length: int, num_heads: int) -> list[_Piece]:
    """Split a long sequence into runs of query blocks whose scores fit in _MAX_SCORES."""
    total = -(-length // Q_BLOCK)
    kv_blocks = -(-(start + length) // KV_BLOCK)
    step = max(1, _MAX_SCORES // (num_heads * Q_BLOCK * kv_blocks * KV_BLOCK))
    return [_Piece(table, start, offset, length, b, min(step, total - b)) for b in range(0, total, step)]


def _chunks(pieces: list[_Piece], num_heads: int) -> list[list[_Piece]]:
    """Batch pieces together while the padded score tensor stays under _MAX_SCORES."""
    chunks: list[list[_Piece]] = []
    current: list[_Piece] = []
    for piece in pieces:
        candidate = current + [piece]
        kv = max(p.kv_blocks for p in candidate)
        if current and len(candidate) * num_heads * piece.q_blocks * Q_BLOCK * kv * KV_BLOCK > _MAX_SCORES:
            chunks.append(current)
            candidate = [piece]
        current = candidate
    return chunks + [current]


def _build_group(pieces: list[_Piece], block_size: int, device: torch.device) -> BlockGroup:
    q_blocks, kv_blocks = pieces[0].q_blocks, max(p.kv_blocks for p in pieces)
    index = torch.tensor([p.first_block * Q_BLOCK for p in pieces])[:, None] + torch.arange(q_blocks * Q_BLOCK)
    lengths = torch.tensor([p.length for p in pieces])[:, None]
    real = index < lengths
    index = torch.minimum(index, lengths - 1)  # padding rows act as the sequence's last token
    positions = torch.tensor([p.start for p in pieces])[:, None] + index
    keys = torch.arange(kv_blocks * KV_BLOCK)
    mask = (keys[None, None, :] <= positions[:, :, None]).view(len(pieces), q_blocks, Q_BLOCK, kv_blocks, KV_BLOCK)
    rows = torch.tensor([p.offset for p in pieces])[:, None] + index
    return BlockGroup(
        tables=_table_tensor([p.table for p in pieces], kv_blocks * KV_BLOCK, block_size, device),
        rows=rows.to(device),
        mask=mask.permute(0, 1, 3, 2, 4).contiguous().to(device),
        src=real.flatten().nonzero().squeeze(1).to(device),
        dst=rows[real].to(device),
    )


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan,
           scale: float) -> torch.Tensor:
    """q: [tokens, heads, head_dim] of the whole batch; caches: [kv_heads, blocks, block_size, head_dim]."""
    if plan.paged is not None:
        from minedraft.model.kernels.triton_attention import paged_attention

        return paged_attention(q, k_cache, v_cache, plan.paged, scale)
    if plan.padded is not None and plan.padded.src is None:
        return _padded_sdpa(q, k_cache, v_cache, plan.padded, scale)  # the whole batch in one call
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.cpu is not None:
        cpu_paged_attention(q, k_cache, v_cache, plan.cpu, scale, out)
        if plan.cpu_covers_all:
            return out
    if plan.padded is not None:
        out[plan.padded.dst] = _padded_sdpa(q, k_cache, v_cache, plan.padded, scale)[plan.padded.src]
    for seq in plan.seqs:
        out[seq.offset : seq.offset + seq.length] = _sdpa(q[seq.offset : seq.offset + seq.length], k_cache,
                                                          v_cache, seq, scale)
    for group in plan.groups:
        out[group.dst] = _block_attention(q, k_cache, v_cache, group, scale).flatten(0, 1)[group.src]
    return out


def _sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: SeqAttention,
          scale: float) -> torch.Tensor:
    end = seq.start + seq.length
    if seq.run is not None:
        k, v = (run_keys(cache, seq.run, end)[0] for cache in (k_cache, v_cache))
    else:
        k, v = (gather_keys(cache, seq.blocks[None], end)[0] for cache in (k_cache, v_cache))
    causal = seq.start == 0 and seq.length > 1
    # With a batch dimension torch runs its flash kernel on CPU (without one, its math fallback: 2.2x slower on a
    # 130-token prompt); the flash kernel's masked rows equal its causal ones bit for bit.
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=seq.mask,
                                         is_causal=causal, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _padded_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: PaddedGroup,
                 scale: float) -> torch.Tensor:
    """[seqs * max_query, heads, head_dim] attention output of the padded group."""
    seqs, max_query = group.rows.shape
    heads, dim = q.shape[1:]
    kv_heads = k_cache.shape[0]
    qb = q if group.src is None else q[group.rows.flatten()]
    # The heads that share a kv head become extra query rows of it: each key is read once per kv head.
    qb = qb.view(seqs, max_query, kv_heads, heads // kv_heads, dim).permute(0, 2, 3, 1, 4)
    qb = qb.reshape(seqs, kv_heads, heads // kv_heads * max_query, dim)
    if group.run is not None:
        k, v = (run_keys(cache, group.run, group.keys) for cache in (k_cache, v_cache))
    else:
        k, v = (gather_keys(cache, group.tables, group.keys) for cache in (k_cache, v_cache))
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=group.mask, scale=scale)
    out = out.view(seqs, kv_heads, heads // kv_heads, max_query, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(seqs * max_query, heads, dim)


def _block_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: BlockGroup,
                     scale: float) -> torch.Tensor:
    """[pieces, q_blocks * Q_BLOCK, heads, head_dim] attention output of one group."""
    pieces, q_blocks, kv_blocks = group.mask.shape[:3]
    heads, dim = q.shape[1:]
    kv_heads = k_cache.shape[0]
    group_size, rows = heads // kv_heads, heads // kv_heads * Q_BLOCK
    # [pieces, kv_heads, q_blocks, 1, group * Q_BLOCK, dim]: GQA heads of one kv head share a GEMM.
    qb = q[group.rows].view(pieces, q_blocks, Q_BLOCK, kv_heads, group_size, dim)
    qb = qb.permute(0, 3, 1, 4, 2, 5).reshape(pieces, kv_heads, q_blocks, 1, rows, dim)
    keys = kv_blocks * KV_BLOCK
    kb = gather_keys(k_cache, group.tables, keys).reshape(pieces, kv_heads, 1, kv_blocks, KV_BLOCK, dim)
    vb = gather_keys(v_cache, group.tables, keys).reshape(pieces, kv_heads, 1, kv_blocks, KV_BLOCK, dim)
    # Softmax in fp32 whatever the model dtype (no-op casts for fp32 models).
    scores = torch.matmul(qb, kb.transpose(-1, -2)).float() * scale  # [p, kv_heads, q, kv, rows, KV_BLOCK]
    scores = scores.view(pieces, kv_heads, q_blocks, kv_blocks, group_size, Q_BLOCK, KV_BLOCK)
    scores = scores.masked_fill(~group.mask[:, None, :, :, None], float("-inf"))
    probs = torch.exp(scores - scores.amax(dim=(3, 6), keepdim=True))  # a max is exact in any order
    # cumsum adds kv blocks strictly left to right: trailing all-zero blocks change no bit.
    denom = probs.sum(-1).cumsum(3)[:, :, :, -1]  # [p, kv_heads, q, group, Q_BLOCK]
    out = torch.matmul(probs.to(vb.dtype).view(pieces, kv_heads, q_blocks, kv_blocks, rows, KV_BLOCK), vb)
    out = out.float().cumsum(3)[:, :, :, -1].view(pieces, kv_heads, q_blocks, group_size, Q_BLOCK, dim)
    out = (out / denom.unsqueeze(-1)).to(q.dtype)
    return out.permute(0, 2, 4, 1, 3, 5).reshape(pieces, q_blocks * Q_BLOCK, heads, dim)
