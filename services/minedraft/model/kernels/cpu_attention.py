"""Paged attention on CPU in C (model/kernels/paged_attention.c): keys and values read in place through the block table.

The torch path gathers a batch's keys and values into one padded rectangle (an index_select per layer) and
hands it to sdpa, so the context crosses memory three times: read, written, read again. On a decode step the
context is most of the bytes a step touches (32 sequences of 250 tokens: 49 MB a step for the bundled
target in fp32, 4 MB of weights), and the gather and sdpa took half of it. This kernel reads the context once,
for short queries (decode, verification, draft steps); prompts keep sdpa's flash attention, which is
compute-bound there.

It is built on first use with the machine's C compiler (model/kernels/cpu_kernels.py). Where no compiler works,
`attention_kernel auto` keeps the torch path and says why once; `attention_kernel cpu` refuses to start.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from minedraft.model.kernels import cpu_kernels


@dataclass
class CpuPagedMeta:
    """The short-query sequences of a forward as the kernel reads them (int32, built once per forward)."""

    tables: torch.Tensor  # [seqs, width] block table of each sequence, padded with the zero block
    starts: torch.Tensor  # [seqs] tokens in the cache before this pass
    offsets: torch.Tensor  # [seqs] the sequence's first row in the flattened batch
    lengths: torch.Tensor  # [seqs] its new tokens (rows)


def cpu_paged_meta(starts: list[int], offsets: list[int], lengths: list[int], tables: list[list[int]],
                   null_block: int) -> CpuPagedMeta:
    width = max(len(t) for t in tables)
    rows = [t + [null_block] * (width - len(t)) for t in tables]

    def as_int32(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return CpuPagedMeta(as_int32(rows), as_int32(starts), as_int32(offsets), as_int32(lengths))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: CpuPagedMeta,
                    scale: float, out: torch.Tensor) -> None:
    """Write the attention of meta's sequences' rows of q ([tokens, heads, head_dim]) into the same rows of
    out; caches: [kv_heads, blocks, block_size, head_dim]. fp32 only."""
    kernel = load()
    tokens, heads, dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    _check(q, k_cache, v_cache, out)
    tables = meta.tables
    status = kernel.paged_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), out.data_ptr(), out.stride(0), out.stride(1), tables.data_ptr(),
        tables.shape[1], meta.starts.data_ptr(), meta.offsets.data_ptr(), meta.lengths.data_ptr(),
        tables.shape[0], heads, kv_heads, dim, block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("paged attention: no memory for its scratch rows")


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"paged attention on CPU takes float32 CPU tensors, got {name} {t.dtype} on {t.device}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or k_cache.stride(2) != k_cache.shape[3]:
        raise ValueError("paged attention on CPU needs caches whose blocks are contiguous [block_size, head_dim]")
    if out.stride(2) != 1 or out.shape != q.shape:
        raise ValueError(f"paged attention on CPU: out must be shaped as q {tuple(q.shape)}, its rows contiguous")


def available() -> str | None:
    """None when the kernel loads here, else why not."""
    return cpu_kernels.unavailable(load)


def load() -> ctypes.CDLL:
    """The built kernel, building it first if this machine has no copy yet."""
    return cpu_kernels.library("paged_attention.c", _declare)


def _declare(lib: ctypes.CDLL) -> None:
    lib.paged_attention_f32.restype = ctypes.c_int
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.paged_attention_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, ptr, ptr,
                                        ptr, i32, i32, i32, i32, i32, ctypes.c_float, i32]  # fmt: skip
