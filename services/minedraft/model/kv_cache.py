"""Paged KV cache: one pool of fixed-size blocks per layer, a block table per sequence.

A sequence holds ceil(length / block_size) blocks, taken from the pool as it grows. A rollback (rejected
drafts) is a smaller length: whole trailing blocks go back to the pool, nothing is copied. Block 0 is
never handed out: it stays zero and pads block tables, so attention can gather a batch's keys as one
rectangle whatever each sequence's length.

Layout per layer: [kv_heads, num_blocks, block_size, head_dim], so gathering a sequence's blocks gives
each head's keys as one contiguous [length, head_dim] matrix.
"""

from __future__ import annotations

import heapq
from numbers import Integral

import torch

NULL_BLOCK = 0
CPU_DEFAULT_KV_BYTES = 4 << 30  # like vLLM's CPU backend: 4 GiB unless told otherwise
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
_ZERO_AHEAD = 64  # blocks zeroed at once when the pool's high-water mark moves


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of `block_size` tokens over all layers."""
    return 2 * num_layers * num_kv_heads * block_size * head_dim * dtype.itemsize


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def kv_budget_bytes(device: torch.device, kv_cache_memory_bytes: int | None,
                    gpu_memory_utilization: float | None) -> tuple[int, str]:
    """Bytes the KV cache may take, and where that number comes from (for error messages).

    On CUDA (vLLM's meaning) the process may use `gpu_memory_utilization` of the device's memory in all;
    what it uses already (weights, once loaded) is subtracted. Call it after the weights are on the device.
    """
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes, f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
    if device.type == "cuda":
        utilization = gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        free, total = torch.cuda.mem_get_info(device)
        budget = int(utilization * total) - (total - free)
        return max(0, budget), (f"gpu_memory_utilization={utilization} of {total} bytes, {total - free} bytes "
                                "already in use")
    return CPU_DEFAULT_KV_BYTES, f"the CPU default of {CPU_DEFAULT_KV_BYTES} bytes (kv_cache_memory_bytes)"


class KVCache:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        """num_blocks: usable blocks (the zero block comes on top)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_kv_heads, num_blocks + 1, block_size, head_dim)
        # Empty, not zeros: pages of a large pool that no block has reached yet are never touched. A block is
        # zeroed when first handed out (masked-out keys are multiplied by 0, and 0 * NaN = NaN).
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._zeroed = 0  # blocks [0, _zeroed) have been zeroed
        self._zero_blocks_below(NULL_BLOCK + 1)
        self._free = list(range(1, num_blocks + 1))  # a heap: the lowest free block first keeps the pool compact
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # tokens written so far per sequence
        self._next_id = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A new, empty sequence; its id indexes block_tables and lengths."""
        seq_id = self._next_id
        self._next_id += 1
        self.block_tables[seq_id], self.lengths[seq_id] = [], 0
        return seq_id

    def free(self, seq_id: int) -> None:
        self.check_allocated(seq_id)
        for block in self.block_tables.pop(seq_id):
            heapq.heappush(self._free, block)
        del self.lengths[seq_id]

    def check_allocated(self, seq_id: int) -> None:
        if isinstance(seq_id, bool) or not isinstance(seq_id, Integral):
            raise ValueError(f"sequence id must be an integer, got {type(seq_id).__name__}")
        if seq_id not in self.block_tables:
            raise ValueError(f"sequence {seq_id} is not allocated")

    def fit(self, seq_id: int, length: int) -> None:
        """Hold exactly the blocks `length` tokens need: free trailing blocks past it, take new ones up to it."""
        table = self.block_tables[seq_id]
        needed = blocks_for(length, self.block_size)
        while len(table) > needed:
            heapq.heappush(self._free, table.pop())
        if needed - len(table) > len(self._free):
            raise RuntimeError(
                f"KV cache is out of blocks: sequence {seq_id} needs {needed - len(table)} more block(s) of "
                f"{self.block_size} tokens, {len(self._free)} of {self.num_blocks} are free"
            )
        new = [heapq.heappop(self._free) for _ in range(needed - len(table))]
        if new:
            self._zero_blocks_below(max(new) + 1)
            table.extend(new)
        self.lengths[seq_id] = min(self.lengths[seq_id], length)

    def token_index(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat pool index (block * block_size + offset) of positions [start, end) of a sequence."""
        table, size = self.block_tables[seq_id], self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([tokens, kv_heads, head_dim]) at flat pool indices `index` ([tokens])."""
        self.k[layer].view(self.k[layer].shape[0], -1, self.k[layer].shape[-1])[:, index] = k.transpose(0, 1)
        self.v[layer].view(self.v[layer].shape[0], -1, self.v[layer].shape[-1])[:, index] = v.transpose(0, 1)

    def _zero_blocks_below(self, end: int) -> None:
        if end <= self._zeroed:
            return
        end = min(self.num_blocks + 1, max(end, self._zeroed + _ZERO_AHEAD))  # a few ops per many blocks
        for cache in (*self.k, *self.v):
            cache[:, self._zeroed : end].zero_()
        self._zeroed = end
