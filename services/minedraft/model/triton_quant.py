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

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, MAX_BLOCK_K = 16, 64, 64
# As in triton_attention.py: the interpreter (Triton 3.9) multiplies 16-bit floats wrongly in tl.dot, so
# interpreted the kernels multiply in float32 (after rounding the weight to the activations' dtype).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def k_tile(granularity: int) -> int:
    """The largest power of two that divides `granularity` (a scale block's or group's width), at most 64:
    one K step of a program then lies within one scale."""
    return min(MAX_BLOCK_K, granularity & -granularity)


def supports_fp8(block: tuple[int, int]) -> bool:
    """Block shapes the FP8 kernel compiles for on a GPU (tl.dot needs K tiles of 16 or more)."""
    return k_tile(block[1]) >= 16


def supports_awq(group: int) -> bool:
    return k_tile(group) >= 16


def fp8_block_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] @ (codes [N, K] x block scales).T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = codes.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _fp8_kernel[grid](
        x, codes.view(torch.uint8), scales, y, m, n, k, x.stride(0), codes.stride(0), scales.stride(0), y.stride(0),
        B0=block[0], B1=block[1], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=k_tile(block[1]), UPCAST=_INTERPRETED,
    )  # fmt: skip
    return y


def awq_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group: int) -> torch.Tensor:
    """x [M, K] @ AWQ's dequantized W.T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = scales.shape[1]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _awq_kernel[grid](
        x, qweight, qzeros, scales, y, m, n, k, x.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0),
        y.stride(0), GROUP=group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=k_tile(group), UPCAST=_INTERPRETED,
    )  # fmt: skip
    return y


@triton.jit
def _fp8_kernel(
    X, Codes, Scales, Y, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        raw = tl.load(Codes + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0)
        scale = tl.load(Scales + (cols // B0) * stride_sn + k0 // B1, mask=col_ok, other=0.0)
        w = (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[None, :]).to(X.dtype.element_ty)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def _awq_kernel(
    X, QWeight, QZeros, Scales, Y, M, N, K, stride_xm, stride_qk, stride_zk, stride_sk, stride_ym,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    # Column c of a group of eight sits in nibble c // 2 + 4 * (c % 2) (AWQ's order 0, 2, 4, 6, 1, 3, 5, 7).
    within = cols % 8
    shifts = ((within // 2) + 4 * (within % 2)) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        both = k_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        packed = tl.load(QWeight + ks[:, None] * stride_qk + (cols // 8)[None, :], mask=both, other=0)
        zeros = tl.load(QZeros + (k0 // GROUP) * stride_zk + cols // 8, mask=col_ok, other=0)
        scale = tl.load(Scales + (k0 // GROUP) * stride_sk + cols, mask=col_ok, other=0.0).to(tl.float32)
        q = (packed >> shifts[None, :]) & 0xF
        zero = (zeros >> shifts) & 0xF
        w = ((q - zero[None, :]).to(tl.float32) * scale[None, :]).to(X.dtype.element_ty)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip
