"""Preallocated KV cache: one slot per sequence, one [slots, kv_heads, length, head_dim] pair per layer."""

from __future__ import annotations

import heapq
from numbers import Integral

import torch

# The cache length is rounded up to whole key blocks so batch-invariant attention can view it in blocks.
KV_BLOCK = 64


class KVCache:
    def __init__(self, *, num_layers: int, num_slots: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(f"num_slots and max_seq_len must be positive, got {num_slots} and {max_seq_len}")
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        length = -(-max_seq_len // KV_BLOCK) * KV_BLOCK
        shape = (num_slots, num_kv_heads, length, head_dim)
        # Zeros, not empty: attention multiplies masked-out (never written) values by 0, and 0 * NaN = NaN.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = list(range(num_slots))  # a heap: the lowest free slot is handed out first
        self._allocated: set[int] = set()
        self.lengths = [0] * num_slots  # tokens written so far per slot (for validation only)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"no free KV-cache slot: all {self.num_slots} slots are in use")
        slot = heapq.heappop(self._free)
        self._allocated.add(slot)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.check_allocated(slot)
        self._allocated.remove(slot)
        heapq.heappush(self._free, slot)

    def check_allocated(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, Integral):
            raise ValueError(f"slot must be an integer, got {type(slot).__name__}")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is out of range [0, {self.num_slots})")
        if slot not in self._allocated:
            raise ValueError(f"slot {slot} is not allocated")

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([tokens, kv_heads, head_dim]) of each token at (its slot, its position)."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v
