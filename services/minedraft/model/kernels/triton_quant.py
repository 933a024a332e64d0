"""Triton GEMMs on quantized weights: y = x @ W.T with W dequantized tile by tile inside the kernel.

The GPU path of model/quantization.py. The weights stay in their checkpoint's form in device memory (one
byte per FP8 weight, half a byte per AWQ weight), and each program dequantizes the tile it multiplies,
exactly as the CPU path dequantizes the whole matrix at load: the weight times its scale in float32,
rounded to the activations' dtype, then a float32-accumulated product. So the two paths differ only in
summation order. Activations are not quantized (weight-only: W8A16 and W4A16).

- `fp8_block_matmul`: float8_e4m3fn codes [N, K] (stored as uint8) and float32 scales, one per
  b0 x b1 block ([ceil(N / b0), ceil(K / b1)]), as `weight_scale_inv` in the checkpoint.
- `awq_matmul`: AWQ's GEMM layout: qweight int32 [K, N / 8] (eight 4-bit values per int32 in AWQ's
  interleaved order), qzeros int32 [K / group, N / 8], scales [K / group, N]; W = (q - zero) x scale.

Importing this module imports triton; nothing on the CPU serving path does. With `TRITON_INTERPRET=1` set
before triton is imported, the kernels run on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_BLOCK_K = 128
# As in triton_attention.py: the interpreter (Triton 3.9) multiplies 16-bit floats wrongly in tl.dot, so
# interpreted the kernels multiply in float32 (after rounding the weight to the activations' dtype).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class GemmTiles:
    """How a GEMM is cut into programs. `split_k` > 1 also cuts K: each slice writes float32 partial sums
    that are added afterwards, so a skinny decode GEMM (a few rows, a long K) fills the GPU's SMs."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def k_tile(granularity: int, limit: int = 64) -> int:
    """The largest power of two that divides `granularity` (a scale block's or group's width), at most
    `limit`: one K step of a program then lies within one scale."""
    return min(limit, granularity & -granularity)


def supports_fp8(block: tuple[int, int]) -> bool:
    """Block shapes the FP8 kernel compiles for on a GPU (tl.dot needs K tiles of 16 or more)."""
    return k_tile(block[1]) >= 16


def supports_awq(group: int) -> bool:
    return k_tile(group) >= 16


def pick_tiles(m: int, n: int, k: int, granularity: int, device: torch.device, block_n: int = 64,
               block_k: int = MAX_BLOCK_K, batch_invariant: bool = False) -> GemmTiles:
    """Tiles for an [m, k] x [k, n] product, K steps within one scale. On a GPU K is split (in powers of
    two, up to 8) until there are about four programs per SM, each slice keeping 8 K steps or more: a
    decode GEMM has few rows, so without it a narrow projection runs on a fraction of the SMs. The
    defaults of each kernel (block_n, block_k) are those benchmarks/quant_tiles.py found best on an H100.
    With `batch_invariant` the tiles do not depend on m (16 rows, K never split): a row's result then
    depends on that row alone, as the strict mode promises."""
    block_m = 16 if m <= 16 or batch_invariant else 32 if m <= 32 else 64
    if device.type != "cuda":
        return GemmTiles(block_m, 64, k_tile(granularity))
    block_k = k_tile(granularity, block_k)
    if batch_invariant:
        return GemmTiles(block_m, block_n, block_k)
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    wanted = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    split = 1
    while split < 8 and programs * split * 2 <= wanted and k_steps // (split * 2) >= 8:
        split *= 2
    return GemmTiles(block_m, block_n, block_k, split)


def _run_split(kernel, grid_args: tuple, x: torch.Tensor, n: int, tiles: GemmTiles, **constants) -> torch.Tensor:
    """Launches `kernel` over (row tiles, column tiles, K slices); sums the slices' partials if K is split."""
    m, k = x.shape
    out = (torch.empty(m, n, dtype=x.dtype, device=x.device) if tiles.split_k == 1 else
           torch.empty(tiles.split_k, m, n, dtype=torch.float32, device=x.device))  # fmt: skip
    k_per_split = triton.cdiv(triton.cdiv(k, tiles.block_k), tiles.split_k) * tiles.block_k
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), tiles.split_k)
    kernel[grid](
        x, *grid_args, out, m, n, k, k_per_split, x.stride(0), n,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT=tiles.split_k > 1,
        UPCAST=_INTERPRETED, num_warps=tiles.num_warps, num_stages=tiles.num_stages, **constants,
    )  # fmt: skip
    return out if tiles.split_k == 1 else out.sum(0).to(x.dtype)


def fp8_block_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                     tiles: GemmTiles | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """x [M, K] @ (codes [N, K] x block scales).T -> [M, N] in x's dtype."""
    x = x.contiguous()
    n = codes.shape[0]
    tiles = tiles or pick_tiles(x.shape[0], n, x.shape[1], block[1], x.device, batch_invariant=batch_invariant)
    _check_k_tile(tiles, block[1])
    return _run_split(_fp8_kernel, (codes.view(torch.uint8), scales, codes.stride(0), scales.stride(0)), x, n, tiles,
                      B0=block[0], B1=block[1])  # fmt: skip


def awq_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group: int, tiles: GemmTiles | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """x [M, K] @ AWQ's dequantized W.T -> [M, N] in x's dtype."""
    x = x.contiguous()
    n = scales.shape[1]
    tiles = tiles or pick_tiles(x.shape[0], n, x.shape[1], group, x.device, block_n=128, block_k=64,
                                batch_invariant=batch_invariant)  # fmt: skip
    _check_k_tile(tiles, group)
    return _run_split(_awq_kernel, (qweight, qzeros, scales, qweight.stride(0), qzeros.stride(0), scales.stride(0)),
                      x, n, tiles, GROUP=group)  # fmt: skip


def _check_k_tile(tiles: GemmTiles, granularity: int) -> None:
    if granularity % tiles.block_k:
        raise ValueError(f"block_k {tiles.block_k} must divide the scale granularity {granularity}")


@triton.jit
def _fp8_kernel(
    X, Codes, Scales, stride_wn, stride_sn, Y, M, N, K, K_PER_SPLIT, stride_xm, stride_ym,
    B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    k_start = tl.program_id(2) * K_PER_SPLIT
    acc = fp8_tile_product(X + rows * stride_xm, row_ok, Codes, Scales, stride_wn, stride_sn, cols, col_ok, K,
                           k_start, k_start + K_PER_SPLIT, B0, B1, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)  # fmt: skip
    _store(Y, acc, rows, cols, row_ok, col_ok, M, stride_ym, SPLIT)


@triton.jit
def _awq_kernel(
    X, QWeight, QZeros, Scales, stride_qk, stride_zk, stride_sk, Y, M, N, K, K_PER_SPLIT, stride_xm, stride_ym,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    k_start = tl.program_id(2) * K_PER_SPLIT
    acc = awq_tile_product(X + rows * stride_xm, row_ok, QWeight, QZeros, Scales, stride_qk, stride_zk, stride_sk,
                           tl.program_id(1), cols, col_ok, N, K, k_start, k_start + K_PER_SPLIT, GROUP, BLOCK_M,
                           BLOCK_N, BLOCK_K, UPCAST)  # fmt: skip
    _store(Y, acc, rows, cols, row_ok, col_ok, M, stride_ym, SPLIT)


# The products of one [BLOCK_M, BLOCK_N] output tile over K in [k_start, k_stop), shared by the dense GEMMs
# here and the grouped expert GEMMs (model/kernels/triton_moe.py): `x_rows` points at each row of X (rows need not
# be contiguous), the weight pointers at one [N, K] matrix. Each K step dequantizes its weight tile in
# float32, rounds it to X's dtype, and accumulates the product in float32.


@triton.jit
def x_tile(x_rows, row_ok, k0, K, BLOCK_K: tl.constexpr):
    """One K step's inputs k0 .. k0 + BLOCK_K, which of them are real, and X's tile there (zeros past K)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    return ks, k_ok, tl.load(x_rows[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def fp8_tile_product(
    x_rows, row_ok, Codes, Scales, stride_wn, stride_sn, cols, col_ok, K, k_start, k_stop,
    B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        ks, k_ok, x = x_tile(x_rows, row_ok, k0, K, BLOCK_K)
        group = tl.minimum(k0, K - 1)  # a step past K (the last slice of a split) reads a real scale, times 0
        raw = tl.load(Codes + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0)
        scale = tl.load(Scales + (cols // B0) * stride_sn + group // B1, mask=col_ok, other=0.0)
        w = (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[None, :]).to(x.dtype)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, w, input_precision="ieee")
    return acc


@triton.jit
def awq_tile_product(
    x_rows, row_ok, QWeight, QZeros, Scales, stride_qk, stride_zk, stride_sk, col_tile, cols, col_ok, N, K,
    k_start, k_stop, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    # Each int32 holds eight columns; column c of a group of eight sits in nibble c // 2 + 4 * (c % 2)
    # (AWQ's order 0, 2, 4, 6, 1, 3, 5, 7). A tile loads each int32 once and unpacks it into its eight.
    packs = col_tile * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    pack_ok = packs < tl.cdiv(N, 8)
    within = tl.arange(0, 8)
    shifts = ((within // 2) + 4 * (within % 2)) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        ks, k_ok, x = x_tile(x_rows, row_ok, k0, K, BLOCK_K)
        group = tl.minimum(k0, K - 1)  # a step past K (the last slice of a split) reads a real scale, times 0
        packed = tl.load(QWeight + ks[:, None] * stride_qk + packs[None, :], mask=k_ok[:, None] & pack_ok[None, :],
                         other=0)  # fmt: skip
        q = tl.reshape((packed[:, :, None] >> shifts[None, None, :]) & 0xF, [BLOCK_K, BLOCK_N])
        zeros = tl.load(QZeros + (group // GROUP) * stride_zk + packs, mask=pack_ok, other=0)
        zero = tl.reshape((zeros[:, None] >> shifts[None, :]) & 0xF, [BLOCK_N])
        scale = tl.load(Scales + (group // GROUP) * stride_sk + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = ((q - zero[None, :]).to(tl.float32) * scale[None, :]).to(x.dtype)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, w, input_precision="ieee")
    return acc


@triton.jit
def _store(Y, acc, rows, cols, row_ok, col_ok, M, stride_ym, SPLIT: tl.constexpr):
    """The tile's result: rounded into Y, or with K split, float32 partials into slice program_id(2)."""
    if SPLIT:
        Y += tl.program_id(2).to(tl.int64) * M * stride_ym
        tl.store(Y + rows[:, None] * stride_ym + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])
    else:
        tl.store(Y + rows[:, None] * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip
