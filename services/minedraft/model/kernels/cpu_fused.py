"""Fused elementwise kernels of a decoder layer on CPU, in C (model/kernels/fused_layers.c): the CPU path's default
mode.

The same calls as model/kernels/triton_fused.py, so the layers' fused form (DecoderLayer.forward_fused) runs
either:

- `add_rms_norm`: the residual add and the RMSNorm after it, returning the normed rows and the new stream;
- `rope_write_kv`: Qwen3's q/k RMSNorm (where the model has one), the rotary embedding of q and k, and the
  paged KV-cache write of k and v;
- `silu_and_mul`: torch's two ops (SiLU and the product each run as one vectorized operator already).

Unfused, these chains are some forty operators per layer, each dispatched from Python; at a decode step of
one sequence their dispatch costs more than the GEMMs of the small bundled models. float32 CPU tensors only
(the runner uses the kernels for float32 models on CPU, `fused_kernels` auto). Results differ from torch's
ops only in the order of the norms' sums; each row is computed alone, the same in any batch.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from minedraft.model.kernels import cpu_kernels, rope_write_inputs


def available() -> str | None:
    """None when the kernels load here, else why not."""
    return cpu_kernels.unavailable(_load)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); residual None: (RMSNorm(x), x). x, residual: [tokens, hidden]."""
    x = _rows(x)
    rows, hidden = x.shape
    out = torch.empty(rows, hidden)
    stream = torch.empty(rows, hidden) if residual is not None else x
    r = _rows(residual) if residual is not None else None
    _load().add_rms_norm_f32(
        x.data_ptr(), x.stride(0), r.data_ptr() if r is not None else None, r.stride(0) if r is not None else 0,
        _contiguous(weight).data_ptr(), out.data_ptr(), stream.data_ptr(), rows, hidden, eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return out, stream


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[tokens, 2 * size] (gate, then up) -> SiLU(gate) * up [tokens, size]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_write_kv(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], token_index: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
                  qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """q normed (Qwen3) and rotated, returned [tokens, heads, head_dim]; k likewise and v written to the caches
    ([kv_heads, blocks, block_size, head_dim]) at `token_index` (KVCache.write's layout). As
    triton_fused.rope_write_kv."""
    qkv, cos, signed_sin, head_dim = rope_write_inputs(qkv, rope, k_cache, v_cache, _rows)
    tokens = qkv.shape[0]
    index = _contiguous(token_index.to(torch.int64))
    q = torch.empty(tokens, heads, head_dim)
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
    _load().rope_write_kv_f32(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), signed_sin.data_ptr(), cos.stride(0), index.data_ptr(),
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        _contiguous(q_norm).data_ptr() if q_norm is not None else None,
        _contiguous(k_norm).data_ptr() if k_norm is not None else None, eps, tokens, heads, kv_heads, head_dim,
        torch.get_num_threads(),
    )  # fmt: skip
    return q


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, width] float32 with unit stride along the width (what the kernels index)."""
    if x.dtype is not torch.float32 or not x.is_cpu:
        raise ValueError(f"the CPU fused kernels take float32 CPU tensors, got {x.dtype} on {x.device}")
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def _load() -> ctypes.CDLL:
    return cpu_kernels.library("fused_layers.c", _declare)


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    lib.add_rms_norm_f32.restype = None
    lib.add_rms_norm_f32.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32, i32]
    lib.rope_write_kv_f32.restype = None
    lib.rope_write_kv_f32.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, f32, i64, i32, i32,
                                      i32, i32]  # fmt: skip
