"""Grouped expert GEMMs in Triton: every routed expert's product in one launch, weights kept as stored.

The GPU path of model/moe.py. The (token, slot) pairs of a batch (slot = the token's i-th expert) are
sorted by expert and laid out in tiles of BLOCK_M rows, each expert's rows padded to whole tiles (as
fused-MoE kernels do), so every tile belongs to one expert. One launch computes gate/up for all experts,
one the down projection: a program reads its tile's expert from a per-tile array and multiplies its rows
by that expert's weight, dequantizing it tile by tile with the same code as the dense GEMMs
(model/kernels/triton_quant.py: `fp8_tile_product`, `awq_tile_product`), so a pair's result is what the dense
kernel gives for that token and expert. Unquantized experts (bf16 or any float) run through the same
launch. Results are written in pair order and combined with the router weights slot by slot.

The routing is laid out on the device without a host sync: buffers are sized for the worst case
(ceil(pairs / BLOCK_M) + min(experts, pairs) tiles), and the tiles past the last expert's exit at once.
K is never split (the experts' tiles fill the GPU), and with `batch_invariant` the tiles do not depend on
the batch either, so a token's result then depends on its own row and its experts only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from minedraft.model.kernels.triton_quant import (
    _INTERPRETED,
    MAX_BLOCK_K,
    GemmTiles,
    awq_tile_product,
    fp8_tile_product,
    k_tile,
    x_tile,
)

if TYPE_CHECKING:
    from minedraft.model.quantization import QuantizedWeight


@dataclass(frozen=True)
class Routing:
    """A batch's (token, slot) pairs sorted by expert into tiles of `block_m` rows.

    `sorted_pairs` [tiles x block_m]: the pair (token x top_k + slot) at each row, `num_pairs` on padding
    rows; `tile_experts` [tiles]: each tile's expert, -1 for the spare tiles past the last expert's."""

    sorted_pairs: torch.Tensor
    tile_experts: torch.Tensor
    block_m: int
    num_pairs: int
    top_k: int


def row_block(pairs: int, num_experts: int, batch_invariant: bool) -> int:
    """Rows per tile: 16 for decode-sized batches (few pairs per expert), up to 64 for prefill. Fixed with
    batch_invariant, so that the tiles do not depend on the batch."""
    if batch_invariant:
        return 16
    per_expert = pairs / max(1, min(num_experts, pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def route(experts: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """Lay out [tokens, top_k] expert ids as tiles (see Routing), on their device without a host sync."""
    flat = experts.flatten().to(torch.int64)
    pairs, device = flat.numel(), flat.device
    max_tiles = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    order = torch.sort(flat, stable=True).indices  # by expert; (token, slot) order within one
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    first_row = (tile_end - tiles) * block_m  # each expert's first row in the padded layout
    first_pair = counts.cumsum(0) - counts  # ... and in `order`
    expert_of = flat[order]
    rows = first_row[expert_of] + torch.arange(pairs, device=device) - first_pair[expert_of]
    sorted_pairs = torch.full((max_tiles * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, rows, order.to(torch.int32))
    tile_experts = torch.searchsorted(tile_end, torch.arange(max_tiles, device=device), right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return Routing(sorted_pairs, tile_experts, block_m, pairs, experts.shape[1])


def grouped_tiles(block_m: int, method: str | None, granularity: int | None, device: torch.device) -> GemmTiles:
    """Tiles for one grouped launch of `method` (fp8, awq, None: unquantized): K steps within one scale
    block or group (`granularity`), K never split; on a GPU the dense kernels' defaults (untuned for the
    grouped ones: benchmarks/quant_tiles.py --grouped sweeps them)."""
    if device.type != "cuda":
        return GemmTiles(block_m, 64, k_tile(granularity) if granularity else 32)
    if method == "awq":
        return GemmTiles(block_m, 128, k_tile(granularity, 64))
    return GemmTiles(block_m, 64, k_tile(granularity, MAX_BLOCK_K) if granularity else 64)


def grouped_matmul(x: torch.Tensor, weight: QuantizedWeight | torch.Tensor, routing: Routing, per_token: bool,
                   tiles: GemmTiles | None = None) -> torch.Tensor:
    """[pairs, N]: each pair's input row times its expert's [N, K] weight (transposed), in x's dtype.

    x holds one row per token (`per_token`: the pair's token's row, as gate/up reads the hidden states) or
    one per pair (as the down projection reads gate/up's output). `weight`: stacked experts, quantized
    ([experts, N, K] as stored) or dense [experts, N, K]."""
    x = x.contiguous()
    stored = weight if isinstance(weight, torch.Tensor) else None
    quant = None if stored is not None else weight.quant
    granularity = None if quant is None else quant.block[1] if quant.method == "fp8" else quant.group_size
    tiles = tiles or grouped_tiles(routing.block_m, quant and quant.method, granularity, x.device)
    if tiles.block_m != routing.block_m or tiles.split_k != 1:
        raise ValueError(f"grouped tiles {tiles} must have the routing's block_m {routing.block_m} and no split-K")
    if granularity is not None and granularity % tiles.block_k:
        raise ValueError(f"block_k {tiles.block_k} must divide the scale granularity {granularity}")
    n, k = (stored.shape[1:] if stored is not None else weight.shape)
    out = torch.empty(routing.num_pairs, n, dtype=x.dtype, device=x.device)
    grid = (routing.tile_experts.numel(), triton.cdiv(n, tiles.block_n))
    shared = (out, routing.sorted_pairs, routing.tile_experts, routing.num_pairs, routing.top_k if per_token else 1,
              n, k, x.stride(0), out.stride(0))  # fmt: skip
    launch = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, UPCAST=_INTERPRETED,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)  # fmt: skip
    if stored is not None:
        _grouped_dense_kernel[grid](x, stored, stored.stride(0), stored.stride(1), *shared, **launch)
    elif quant.method == "fp8":
        codes, scales = weight.parts["weight"], weight.parts["scale"]
        _grouped_fp8_kernel[grid](x, codes.view(torch.uint8), scales, codes.stride(0), codes.stride(1),
                                  scales.stride(0), scales.stride(1), *shared, B0=quant.block[0], B1=quant.block[1],
                                  **launch)  # fmt: skip
    else:
        qweight, qzeros, scales = (weight.parts[p] for p in ("qweight", "qzeros", "scales"))
        _grouped_awq_kernel[grid](x, qweight, qzeros, scales, qweight.stride(0), qzeros.stride(0), scales.stride(0),
                                  qweight.stride(1), qzeros.stride(1), scales.stride(1), *shared,
                                  GROUP=quant.group_size, **launch)  # fmt: skip
    return out


def fused_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                  w13: QuantizedWeight | torch.Tensor, w2: QuantizedWeight | torch.Tensor, num_experts: int,
                  batch_invariant: bool) -> torch.Tensor:
    """The routed experts' weighted sum for each token ([tokens, hidden]): gate/up for every (token, slot)
    pair in one launch, SiLU(gate) x up, down in one launch, then each token's slots weighted and added in
    slot order (no atomics: the sum's order is fixed)."""
    tokens, top_k = experts.shape
    routing = route(experts, num_experts, row_block(tokens * top_k, num_experts, batch_invariant))
    gate, up = grouped_matmul(x, w13, routing, per_token=True).chunk(2, dim=-1)
    down = grouped_matmul(torch.nn.functional.silu(gate) * up, w2, routing, per_token=False)
    return (down.view(tokens, top_k, -1) * weights[:, :, None]).sum(1)


@triton.jit
def _tile(SortedPairs, TileExperts, num_pairs, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's expert (int64; -1: a spare tile), its rows' pairs and which rows are real, its output
    columns and which are real."""
    tile = tl.program_id(0)
    pairs = tl.load(SortedPairs + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(TileExperts + tile).to(tl.int64), pairs, pairs < num_pairs, cols, cols < N


@triton.jit
def _store_rows(Y, acc, pairs, row_ok, cols, col_ok, stride_ym):
    tl.store(Y + pairs[:, None] * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def _grouped_fp8_kernel(
    X, Codes, Scales, stride_ce, stride_cn, stride_se, stride_sn, Y, SortedPairs, TileExperts, num_pairs, x_div,
    N, K, stride_xm, stride_ym, B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    e, pairs, row_ok, cols, col_ok = _tile(SortedPairs, TileExperts, num_pairs, N, BLOCK_M, BLOCK_N)
    if e < 0:  # a spare tile
        return
    acc = fp8_tile_product(X + (pairs // x_div) * stride_xm, row_ok, Codes + e * stride_ce, Scales + e * stride_se,
                           stride_cn, stride_sn, cols, col_ok, K, 0, K, B0, B1, BLOCK_M, BLOCK_N, BLOCK_K,
                           UPCAST)  # fmt: skip
    _store_rows(Y, acc, pairs, row_ok, cols, col_ok, stride_ym)


@triton.jit
def _grouped_awq_kernel(
    X, QWeight, QZeros, Scales, stride_qe, stride_ze, stride_se, stride_qk, stride_zk, stride_sk, Y, SortedPairs,
    TileExperts, num_pairs, x_div, N, K, stride_xm, stride_ym, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    e, pairs, row_ok, cols, col_ok = _tile(SortedPairs, TileExperts, num_pairs, N, BLOCK_M, BLOCK_N)
    if e < 0:  # a spare tile
        return
    acc = awq_tile_product(X + (pairs // x_div) * stride_xm, row_ok, QWeight + e * stride_qe, QZeros + e * stride_ze,
                           Scales + e * stride_se, stride_qk, stride_zk, stride_sk, tl.program_id(1), cols, col_ok,
                           N, K, 0, K, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)  # fmt: skip
    _store_rows(Y, acc, pairs, row_ok, cols, col_ok, stride_ym)


@triton.jit
def _grouped_dense_kernel(
    X, W, stride_we, stride_wn, Y, SortedPairs, TileExperts, num_pairs, x_div, N, K, stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    expert, pairs, row_ok, cols, col_ok = _tile(SortedPairs, TileExperts, num_pairs, N, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    W += expert * stride_we
    x_rows = X + (pairs // x_div) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks, k_ok, x = x_tile(x_rows, row_ok, k0, K, BLOCK_K)
        w = tl.load(W + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        w = w.to(x.dtype)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, w, input_precision="ieee")
    _store_rows(Y, acc, pairs, row_ok, cols, col_ok, stride_ym)
