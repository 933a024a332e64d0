"""Batched LoRA in Triton: the GPU path of model/lora.py's `LoraSlots.add_to`, in the default mode.

The torch path multiplies every token by the A of every slot and masks all but its own slot's columns, so
its work grows with the number of slots. Here each token multiplies only its own slot's A and B, in two
kernels over the same pools (A stacked [slots * width, in], B [out, slots * width], width = parts x
max_rank, slot 0 = no adapter), as Punica's and S-LoRA's shrink / expand do:

- `shrink`: h = x A_s^T for each token's slot s, [tokens, width], rounded to x's dtype (as the torch path's
  first GEMM rounds it);
- `expand`: y += h B_s^T, the product rounded to y's dtype before the add (as the torch path's second GEMM
  and add round). A packed projection (q/k/v, gate/up) expands each part on its own: part p's output rows
  take only part p's `max_rank` columns of h, the only columns where lora.py's B is not zero for them, so
  the work is that of one projection per part, not of every part's rank against every output.

Tokens are not sorted by adapter: a program takes a tile of tokens and one slot, multiplies the rows of that
tile whose token is in its slot, and does nothing where none is. Slot 0 (and any index below 1) is no
adapter and never multiplied. The launch grids depend on the token count and the number of slots only, and
the slots are read from a tensor, so a captured CUDA graph replays with new adapters per token.

Tensor parallel needs nothing here: lora.py already holds this rank's rows of B (column-parallel) or its
input columns of A (row-parallel, the partial sums reduced with the base layer's).

Importing this module imports triton; nothing on the CPU path does. With `TRITON_INTERPRET=1` set before
triton is imported, the kernels run on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # shrink: the input dim is walked in steps of this
BLOCK_N = 64  # expand: output columns per program
# As in triton_quant.py: the interpreter multiplies 16-bit floats wrongly in tl.dot, so interpreted the
# kernels multiply in float32 (the operands are already in the model's dtype, so nothing else changes).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _block_m(tokens: int) -> int:
    return 16 if tokens <= 16 else 32 if tokens <= 64 else 64


def _dot_width(n: int) -> int:
    """A tile side for tl.dot: a power of two, 16 at least."""
    return max(16, triton.next_power_of_2(n))


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
             part_rows: torch.Tensor, longest_part: int, max_rank: int) -> torch.Tensor:
    """y + (x A_s^T) B_s^T for each token's slot s, written into y where its rows are unit-stride.

    y [tokens, out]; x [tokens, in]; a [num_slots * width, in]; b [out, num_slots * width]; slots [tokens]
    (below 1: no adapter); part_rows int32 [parts, 2] on y's device: each part's first output row in y and
    its row count (the largest: longest_part, known on the host), its columns of h being p * max_rank onwards
    (lora.py's layout: width = parts * max_rank)."""
    width = part_rows.shape[0] * max_rank
    return expand(y, shrink(x, a, slots, width), b, slots, part_rows, longest_part, max_rank)


def shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
    """h [tokens, width] = x A_s^T per token (rows of tokens without an adapter are left unwritten)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    tokens, inp = x.shape
    h = torch.empty(tokens, width, dtype=x.dtype, device=x.device)
    block_m = _block_m(tokens)
    grid = (triton.cdiv(tokens, block_m), a.shape[0] // width - 1)
    _shrink_kernel[grid](
        x, a, slots, h, tokens, inp, x.stride(0), a.stride(0),
        WIDTH=width, BLOCK_M=block_m, BLOCK_R=_dot_width(width), BLOCK_K=BLOCK_K, UPCAST=_INTERPRETED,
    )  # fmt: skip
    return h


def expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, part_rows: torch.Tensor,
           longest_part: int, max_rank: int) -> torch.Tensor:
    """y += h_p B_{s,p}^T per token and part p (see add_lora); returns y (a copy if its rows were strided)."""
    y = y if y.stride(-1) == 1 else y.contiguous()
    tokens = y.shape[0]
    parts = part_rows.shape[0]
    width = parts * max_rank
    tiles = triton.cdiv(longest_part, BLOCK_N)
    block_m = _block_m(tokens)
    grid = (triton.cdiv(tokens, block_m), b.shape[1] // width - 1, parts * tiles)
    _expand_kernel[grid](
        h, b, slots, part_rows, y, tokens, h.stride(0), b.stride(0), y.stride(0), tiles,
        WIDTH=width, RANK=max_rank, BLOCK_M=block_m, BLOCK_R=_dot_width(max_rank), BLOCK_N=BLOCK_N,
        UPCAST=_INTERPRETED,
    )  # fmt: skip
    return y


@triton.jit
def _token_tile(Slots, tokens, BLOCK_M: tl.constexpr):
    """This program's rows (a tile of tokens) and which of them are in its slot (1 + program_id(1))."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.program_id(1) + 1
    in_slot = tl.load(Slots + rows, mask=rows < tokens, other=0) == slot
    return rows.to(tl.int64), slot.to(tl.int64), in_slot


@triton.jit
def _shrink_kernel(
    X, A, Slots, H, tokens, inp, stride_x, stride_a,
    WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    rows, slot, in_slot = _token_tile(Slots, tokens, BLOCK_M)
    if tl.max(in_slot.to(tl.int32), axis=0) > 0:  # a tile with no token of this slot does nothing
        cols = tl.arange(0, BLOCK_R)
        col_ok = cols < WIDTH
        a_rows = A + (slot * WIDTH + cols) * stride_a
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(0, inp, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < inp
            x = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=in_slot[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_rows[None, :] + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                x, a = x.to(tl.float32), a.to(tl.float32)
            acc += tl.dot(x, a, input_precision="ieee")
        tl.store(H + rows[:, None] * WIDTH + cols[None, :], acc.to(H.dtype.element_ty),
                 mask=in_slot[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def _expand_kernel(
    H, B, Slots, PartRows, Y, tokens, stride_h, stride_b, stride_y, tiles,
    WIDTH: tl.constexpr, RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    rows, slot, in_slot = _token_tile(Slots, tokens, BLOCK_M)
    part, tile = tl.program_id(2) // tiles, tl.program_id(2) % tiles
    first, length = tl.load(PartRows + 2 * part), tl.load(PartRows + 2 * part + 1)
    within = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if (tl.max(in_slot.to(tl.int32), axis=0) > 0) & (tile * BLOCK_N < length):
        cols = (first + within).to(tl.int64)
        col_ok = within < length
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < RANK
        h_cols = part * RANK + ranks
        h = tl.load(H + rows[:, None] * stride_h + h_cols[None, :], mask=in_slot[:, None] & rank_ok[None, :],
                    other=0.0)  # fmt: skip
        b = tl.load(B + cols[None, :] * stride_b + slot * WIDTH + h_cols[:, None],
                    mask=rank_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        if UPCAST:
            h, b = h.to(tl.float32), b.to(tl.float32)
        delta = tl.dot(h, b, input_precision="ieee").to(Y.dtype.element_ty).to(tl.float32)
        out = Y + rows[:, None] * stride_y + cols[None, :]
        ok = in_slot[:, None] & col_ok[None, :]
        y = tl.load(out, mask=ok, other=0.0).to(tl.float32)
        tl.store(out, (y + delta).to(Y.dtype.element_ty), mask=ok)
