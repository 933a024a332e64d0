"""Paged attention in Triton: keys and values read in place through the block table, no gather.

The GPU path's attention for every pass (decode, k + 1 verification tokens, draft steps, prefill): one
program per (sequence, kv head, block of BLOCK_M query rows, partition of PARTITION keys) walks its cache blocks with
an online softmax, so the context is read once and never copied. Queries sit bottom-right as everywhere
in the engine: query i of a sequence is at position start + i and sees keys 0 .. start + i. GQA: query
head h reads kv head h // (heads / kv_heads), and one program serves all the heads of one kv head (its
rows are (query, head) pairs), so a decode step reads each kv head's cache once, not once per query head.

Importing this module imports triton; nothing on the CPU path does. With `TRITON_INTERPRET=1` set before
triton is imported, the same kernel runs on CPU tensors, which is how CI tests it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # (query row, head) pairs per program (tl.dot needs at least 16 on a GPU)
KEYS_PER_STEP = 64  # keys a program reads per loop step: several small cache blocks at once
# Keys per partition: a long context is cut into partitions read by programs of their own, whose results
# are merged (as flash-decoding does), so a decode step of a few sequences still fills the GPU.
PARTITION = 128
MIN_BLOCK_SIZE = 16  # cache blocks of fewer tokens are below tl.dot's minimum tile
# Triton's interpreter multiplies 16-bit floats wrongly in tl.dot (3.9): interpreted, the kernel upcasts its
# dot operands to fp32. Compiled for a GPU it multiplies bf16/fp16 on the tensor cores.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class PagedMeta:
    """A forward's sequences as the kernel reads them (device tensors, built once per forward)."""

    block_tables: torch.Tensor  # [seqs, width] int32, padded with the zero block
    starts: torch.Tensor  # [seqs] int32: tokens in the cache before this pass
    query_starts: torch.Tensor  # [seqs + 1] int32: each sequence's first row in the flattened batch
    max_query_len: int
    max_keys: int  # an upper bound on any sequence's start + length (the grid's partitions cover it)


def paged_meta(starts: list[int], lengths: list[int], tables: list[list[int]], null_block: int,
               device: torch.device) -> PagedMeta:
    width = max(len(t) for t in tables)
    rows = [t + [null_block] * (width - len(t)) for t in tables]
    query_starts = [0]
    for n in lengths:
        query_starts.append(query_starts[-1] + n)
    as_int32 = {"dtype": torch.int32, "device": device}
    return PagedMeta(torch.tensor(rows, **as_int32), torch.tensor(starts, **as_int32),
                     torch.tensor(query_starts, **as_int32), max(lengths), max(s + n for s, n in zip(starts, lengths)))


def supports(block_size: int, head_dim: int) -> bool:
    """Shapes the kernel compiles for on a GPU (the interpreter would take any)."""
    return block_size >= MIN_BLOCK_SIZE and block_size & (block_size - 1) == 0 and head_dim >= 16


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMeta,
                    scale: float, partition: int = PARTITION) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; caches: [kv_heads, blocks, block_size, head_dim] -> [tokens, heads, head_dim]."""
    tokens, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = heads // kv_heads
    q = q.contiguous()
    parts = triton.cdiv(meta.max_keys, partition)
    out = torch.empty_like(q)
    # With more than one partition each writes its softmax state (unnormalised output, running max and
    # sum per row); _combine_kernel merges them.
    acc = torch.empty(parts, tokens, heads, head_dim, dtype=torch.float32, device=q.device) if parts > 1 else out
    stats = torch.empty(2, parts, tokens, heads, dtype=torch.float32, device=q.device) if parts > 1 else out
    grid = (meta.starts.shape[0], kv_heads, triton.cdiv(meta.max_query_len * group, BLOCK_M) * parts)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, acc, stats, meta.block_tables, meta.starts, meta.query_starts,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0), scale, parts, tokens * heads, heads,
        GROUP=group, BLOCK_SIZE=block_size, KEYS=max(KEYS_PER_STEP, block_size), PARTITION=partition,
        SPLIT=parts > 1, BLOCK_M=BLOCK_M, BLOCK_D=triton.next_power_of_2(head_dim), HEAD_DIM=head_dim,
        UPCAST=_INTERPRETED,
    )  # fmt: skip
    if parts > 1:
        _combine_kernel[(tokens * heads,)](acc, stats, out, parts, tokens * heads, out.stride(0), out.stride(1), heads,
                                           BLOCK_D=triton.next_power_of_2(head_dim), HEAD_DIM=head_dim)  # fmt: skip
    return out


@triton.jit
def _combine_kernel(Acc, Stats, Out, parts, rows, stride_ot, stride_oh, num_heads,
                    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """One program per (token, head) row: its output from the partitions' states, each weighted by exp(its max -
    the overall max). One kernel where torch's ops took six (a fifth of an 8B decode step's small kernels on an
    H200). The partitions are added one by one in order, and a partition where a row saw no key (max -inf,
    state 0) adds exactly 0: a row's output does not depend on how many partitions the batch's longest
    sequence needed."""
    row = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    top = tl.load(Stats + row)  # partition 0 holds key 0, which every row sees: finite
    for part in range(1, parts):
        top = tl.maximum(top, tl.load(Stats + part * rows + row))
    out = tl.zeros([BLOCK_D], tl.float32)
    total = 0.0
    for part in range(parts):
        weight = tl.exp(tl.load(Stats + part * rows + row) - top)
        total += tl.load(Stats + (parts + part) * rows + row) * weight
        out += tl.load(Acc + (part * rows + row) * HEAD_DIM + dims, mask=dim_ok, other=0.0) * weight
    token, head = row // num_heads, row % num_heads
    tl.store(Out + token * stride_ot + head * stride_oh + dims, (out / total).to(Out.dtype.element_ty), mask=dim_ok)


@triton.jit
def _paged_attention_kernel(
    Q, K, V, Out, Acc, Stats, block_tables, starts, query_starts,
    stride_qt, stride_qh, stride_kh, stride_kb, stride_kt, stride_ot, stride_oh, stride_table,
    scale, parts, rows_per_part, num_heads,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr, PARTITION: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    row_block, part = tl.program_id(2) // parts, tl.program_id(2) % parts
    first_row = tl.load(query_starts + seq)
    length = tl.load(query_starts + seq + 1) - first_row
    if row_block * BLOCK_M < length * GROUP:
        start = tl.load(starts + seq)
        # A program's rows are (query row, head) pairs of one kv head: the GROUP heads that share it read
        # its keys and values once.
        packed = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        rows, heads = packed // GROUP, kv_head * GROUP + packed % GROUP
        dims = tl.arange(0, BLOCK_D)
        row_ok, dim_ok = rows < length, dims < HEAD_DIM
        q_ptrs = Q + (first_row + rows)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        kv_base = kv_head * stride_kh
        keys = tl.arange(0, KEYS)
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # The keys this program reads: its partition's, up to the last key any of its rows sees (slots past
        # the sequence's end hold whatever an earlier sequence left: never read them). Partitions are fixed
        # spans of positions, so a sequence's result does not depend on the batch around it.
        last_key = start + tl.minimum(length - 1, ((row_block + 1) * BLOCK_M - 1) // GROUP)
        end = tl.minimum((part + 1) * PARTITION, last_key + 1)
        for first in range(part * PARTITION, end, KEYS):  # KEYS keys (one or more cache blocks) per step
            positions = first + keys
            key_ok = positions < end
            block = tl.load(block_tables + seq * stride_table + positions // BLOCK_SIZE, mask=key_ok, other=0)
            kv_ptrs = kv_base + block.to(tl.int64)[:, None] * stride_kb + (positions % BLOCK_SIZE)[:, None] * stride_kt
            kv_ok = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(K + kv_ptrs + dims[None, :], mask=kv_ok, other=0.0)
            v = tl.load(V + kv_ptrs + dims[None, :], mask=kv_ok, other=0.0)
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            visible = key_ok[None, :] & (positions[None, :] <= (start + rows)[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            best_now = tl.maximum(best, tl.max(scores, axis=1))
            # -inf while a row has seen no key yet (possible in a partition after the first): then 0.
            shift = tl.where(best_now == float("-inf"), 0.0, best_now)
            probs = tl.exp(scores - shift[:, None])
            rescale = tl.exp(best - shift)
            total = total * rescale + tl.sum(probs, axis=1)
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
            best = best_now
        o_rows = (first_row + rows)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        o_ok = row_ok[:, None] & dim_ok[None, :]
        if SPLIT:  # this partition's state: Acc [parts, tokens, heads, head_dim], Stats [2, parts, tokens, heads]
            tl.store(Acc + part.to(tl.int64) * rows_per_part * HEAD_DIM + o_rows, acc, mask=o_ok)
            s_rows = part.to(tl.int64) * rows_per_part + (first_row + rows) * num_heads + heads
            tl.store(Stats + s_rows, best, mask=row_ok)
            tl.store(Stats + parts * rows_per_part + s_rows, total, mask=row_ok)
        else:  # key 0, in the only partition, is visible to every row: total > 0
            tl.store(Out + o_rows, (acc / total[:, None]).to(Out.dtype.element_ty), mask=o_ok)
