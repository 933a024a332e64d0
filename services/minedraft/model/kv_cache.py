"""Preallocated KV cache: one slot per sequence, one [slots, kv_heads, length, head_dim] pair per layer.

Slots are split into equal regions, one per batch the engine keeps (MineDraft keeps two), and a sequence
takes a slot in its batch's region: a batch's slots stay close together, so attention reads a batch's
range of slots in place (see attention.PaddedGroup).
"""

from __future__ import annotations

import bisect
import heapq
from numbers import Integral

import torch

# The cache length is rounded up to whole key blocks so batch-invariant attention can view it in blocks.
KV_BLOCK = 64


class KVCache:
    def __init__(self, *, num_layers: int, num_slots: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, num_regions: int = 1) -> None:
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(f"num_slots and max_seq_len must be positive, got {num_slots} and {max_seq_len}")
        if not 1 <= num_regions <= num_slots:
            raise ValueError(f"num_regions must be in [1, {num_slots}], got {num_regions}")
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        length = -(-max_seq_len // KV_BLOCK) * KV_BLOCK
        shape = (num_slots, num_kv_heads, length, head_dim)
        # Zeros, not empty: attention multiplies masked-out (never written) values by 0, and 0 * NaN = NaN.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._region_starts = [num_slots * r // num_regions for r in range(num_regions)]
        # One heap per region: the lowest free slot of a region is handed out first.
        self._free = [list(range(lo, hi)) for lo, hi in zip(self._region_starts, self._region_starts[1:] + [num_slots])]
        self._allocated: set[int] = set()
        self.lengths = [0] * num_slots  # tokens written so far per slot (for validation only)

    @property
    def num_free_slots(self) -> int:
        return sum(len(free) for free in self._free)

    def allocate(self, region: int = 0) -> int:
        """The lowest free slot of `region` (of another region when that one is full)."""
        if not self.num_free_slots:
            raise RuntimeError(f"no free KV-cache slot: all {self.num_slots} slots are in use")
        free = self._free[region % len(self._free)] or next(f for f in self._free if f)
        slot = heapq.heappop(free)
        self._allocated.add(slot)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.check_allocated(slot)
        self._allocated.remove(slot)
        heapq.heappush(self._free[bisect.bisect_right(self._region_starts, slot) - 1], slot)

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
