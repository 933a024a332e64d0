"""Fused elementwise kernels of a decoder layer, in Triton: the GPU path's default mode.

Unfused, a decode step launches some thirty small kernels per layer besides its GEMMs (RMSNorm alone is
eight: cast, square, mean, rsqrt, ...); on a GPU each costs a few microseconds however little it moves.
Here each chain is one kernel, as vLLM does it:

- `add_rms_norm`: the residual add and the RMSNorm after it (one program per row), returning the normed row
  and the new residual stream;
- `rope_write_kv`: Qwen3's q/k RMSNorm (where the model has one), the rotary embedding of q and k, and the
  paged KV-cache write of k and v (one program per token and head);
- `silu_and_mul`: the gated MLP's SiLU(gate) * up.

Each rounds to the model's dtype where the torch ops it replaces round (a product of two 16-bit floats is
exact in fp32, so x * cos rounded once is torch's x * cos), so the results differ from the unfused ops only
in the order of the norms' sums. Every program reads its own row or head: the result of a token does not
depend on the batch around it. Launch grids depend on tensor shapes only (CUDA graphs capture them).

Importing this module imports triton; nothing on the CPU path does. With `TRITON_INTERPRET=1` set before
triton is imported, the kernels run on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minedraft.model.kernels import rope_write_inputs

_ELEMENTS_PER_PROGRAM = 1024  # silu_and_mul: a row of the MLP's intermediate size is cut into these


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, width] with unit stride along the width (what the kernels index)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _warps(block: int) -> int:
    """Enough warps that a row of `block` elements takes a few registers per thread."""
    return max(1, min(16, block // 512))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); residual None: (RMSNorm(x), x). x, residual: [tokens, hidden]."""
    x = _rows(x)
    tokens, hidden = x.shape
    add = residual is not None
    residual = _rows(residual) if add else x  # without one, the kernel neither reads it nor writes `stream`
    out, stream = torch.empty_like(x), torch.empty_like(x) if add else x
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(tokens,)](
        x, residual, weight, out, stream, x.stride(0), residual.stride(0), eps,
        HIDDEN=hidden, BLOCK=block, ADD=add, num_warps=_warps(block),
    )  # fmt: skip
    return out, stream


@triton.jit
def _add_rms_norm_kernel(X, Residual, Weight, Out, Stream, stride_x, stride_r, eps,
                         HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:  # the sum rounded to the dtype, as the unfused add stores it, then normed from that
        x = (x.to(tl.float32) + tl.load(Residual + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(Stream.dtype.element_ty)
        tl.store(Stream + row * HIDDEN + cols, x, mask=ok)
    x = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    normed = (x * inv_rms).to(Out.dtype.element_ty).to(tl.float32)  # Hugging Face: normed, cast, then weighted
    weight = tl.load(Weight + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * HIDDEN + cols, (weight * normed).to(Out.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[tokens, 2 * size] (gate, then up) -> SiLU(gate) * up [tokens, size]."""
    gate_up = _rows(gate_up)
    tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, size, dtype=gate_up.dtype, device=gate_up.device)
    grid = (tokens, triton.cdiv(size, _ELEMENTS_PER_PROGRAM))
    _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), SIZE=size, BLOCK=_ELEMENTS_PER_PROGRAM)
    return out


@triton.jit
def _silu_and_mul_kernel(GateUp, Out, stride_in, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < SIZE
    gate = tl.load(GateUp + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_in + SIZE + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)  # rounded, as F.silu's output
    tl.store(Out + row * SIZE + cols, (silu * up).to(Out.dtype.element_ty), mask=ok)


def rope_write_kv(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], token_index: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
                  qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """The attention's inputs from the QKV projection's output in one kernel: q returned, k and v written.

    qkv: [tokens, (heads + 2 * kv_heads) * head_dim]; rope: each token's cos and signed sin, [tokens, 1,
    head_dim] (RotaryEmbedding.table); token_index: [tokens] flat cache index (block * block_size + offset);
    caches: [kv_heads, blocks, block_size, head_dim]; qk_norm: (q_norm weight, k_norm weight, eps) where the
    model norms q and k per head (Qwen3). Returns q [tokens, heads, head_dim], normed and rotated; k is
    normed, rotated and written with v at `token_index` (KVCache.write's layout)."""
    qkv, cos, signed_sin, head_dim = rope_write_inputs(qkv, rope, k_cache, v_cache, _rows)
    tokens = qkv.shape[0]
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)  # unread without a norm
    _rope_write_kv_kernel[(tokens, heads + 2 * kv_heads)](
        qkv, cos, signed_sin, token_index, q, k_cache, v_cache, q_weight, k_weight,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), eps,
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        NORM=qk_norm is not None,
    )  # fmt: skip
    return q


@triton.jit
def _rope_write_kv_kernel(
    QKV, Cos, SignedSin, TokenIndex, QOut, KCache, VCache, QNorm, KNorm,
    stride_qkv, stride_rope, stride_cache_head, eps,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
):  # fmt: skip
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    ok = dims < HEAD_DIM
    src = QKV + token * stride_qkv + head * HEAD_DIM
    slot = tl.load(TokenIndex + token).to(tl.int64)
    dtype = QOut.dtype.element_ty
    rolled = (dims + HEAD_DIM // 2) % HEAD_DIM  # x.roll(head_dim // 2) reads x there
    if head < HEADS + KV_HEADS:  # q or k: normed (Qwen3), then rotated
        x = tl.load(src + dims, mask=ok, other=0.0).to(tl.float32)
        x_rolled = tl.load(src + rolled, mask=ok, other=0.0).to(tl.float32)
        if NORM:  # weight * (x / rms(x)), each product rounded as the unfused ops round it
            inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
            weight = _norm_weight(head < HEADS, QNorm, KNorm, dims, ok)
            weight_rolled = _norm_weight(head < HEADS, QNorm, KNorm, rolled, ok)
            x = (weight * (x * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x_rolled = (weight_rolled * (x_rolled * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        cos = tl.load(Cos + token * stride_rope + dims, mask=ok, other=0.0).to(tl.float32)
        sin = tl.load(SignedSin + token * stride_rope + dims, mask=ok, other=0.0).to(tl.float32)
        rotated = ((x * cos).to(dtype).to(tl.float32) + (x_rolled * sin).to(dtype).to(tl.float32)).to(dtype)
        if head < HEADS:
            tl.store(QOut + (token * HEADS + head) * HEAD_DIM + dims, rotated, mask=ok)
        else:
            k_ptr = KCache + (head - HEADS).to(tl.int64) * stride_cache_head + slot * HEAD_DIM
            tl.store(k_ptr + dims, rotated.to(KCache.dtype.element_ty), mask=ok)
    else:  # v: stored as it is
        v_ptr = VCache + (head - HEADS - KV_HEADS).to(tl.int64) * stride_cache_head + slot * HEAD_DIM
        tl.store(v_ptr + dims, tl.load(src + dims, mask=ok, other=0.0), mask=ok)


@triton.jit
def _norm_weight(is_q, QNorm, KNorm, dims, ok):
    """q_norm's weight at `dims` for a q head, k_norm's for a k head (fp32)."""
    q_weight = tl.load(QNorm + dims, mask=ok, other=0.0)
    return tl.where(is_q, q_weight, tl.load(KNorm + dims, mask=ok, other=0.0)).to(tl.float32)
