"""Paged KV cache: one pool of fixed-size blocks per layer, a block table per sequence.

A sequence holds ceil(length / block_size) blocks, taken from the pool as it grows. A rollback (rejected
drafts) is a smaller length: whole trailing blocks go back to the pool, nothing is copied. Block 0 is
never handed out: it stays zero and pads block tables, so attention can gather a batch's keys as one
rectangle whatever each sequence's length.

Layout per layer: [kv_heads, num_blocks, block_size, head_dim], so gathering a sequence's blocks gives
each head's keys as one contiguous [length, head_dim] matrix.

Prefix caching (automatic, as vLLM's): a full block whose tokens are committed is indexed by its content,
the block's tokens and the entry of the block before it (a chain, so equal blocks after different prefixes
never meet). A new sequence takes the longest indexed chain its tokens start with, sharing those blocks
(reference counts), and writes only the rest. Blocks no sequence holds stay indexed and are reused, least
recently used first, only when the free pool is empty. The index compares whole token tuples, so two
different prefixes can never share a block, whatever their hashes.

Two sequences that computed equal blocks side by side (admitted together, before either was indexed)
end up sharing the one indexed first: the other's copy goes back to the pool. So every indexed block is
held once, however many sequences hold it, which is what admission counts on (engine/batch_manager.py).

A shared block is never written again: a sequence takes only full blocks below its last token (whose
logits must be computed), and a worker indexes only blocks below its last committed token, which no
rollback reaches.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from numbers import Integral

import torch

NULL_BLOCK = 0
CPU_DEFAULT_KV_BYTES = 4 << 30  # like vLLM's CPU backend: 4 GiB unless told otherwise
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
_ZERO_AHEAD = 64  # blocks zeroed at once when the pool's high-water mark moves


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                    feature_dim: int = 0) -> int:
    """Keys and values of `block_size` tokens over all layers (and their features, where the cache keeps them)."""
    return (2 * num_layers * num_kv_heads * head_dim + feature_dim) * block_size * dtype.itemsize


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
                 dtype: torch.dtype, device: torch.device | str, enable_prefix_caching: bool = False,
                 feature_dim: int = 0) -> None:
        """num_blocks: usable blocks (the zero block comes on top). feature_dim: a target feeding an EAGLE head
        also keeps each position's features (`write_features`), so a reused block brings them along."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # The zero block, the usable ones, and a scratch block that padding tokens of a CUDA graph's fixed-size
        # batch write to (model/graphs.py): no sequence ever reads it.
        shape = (num_kv_heads, num_blocks + 2, block_size, head_dim)
        self.scratch_block = num_blocks + 1
        # Empty, not zeros: pages of a large pool that no block has reached yet are never touched. A block is
        # zeroed when first handed out (masked-out keys are multiplied by 0, and 0 * NaN = NaN).
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Read only at positions a forward wrote (a reused prefix): never zeroed.
        self.features = (torch.empty(((num_blocks + 2) * block_size, feature_dim), dtype=dtype, device=device)
                         if feature_dim else None)  # fmt: skip
        self._zeroed = 0  # blocks [0, _zeroed) have been zeroed
        self._zero_blocks_below(NULL_BLOCK + 1)
        # A heap (the lowest free block first keeps the pool compact) beside the set of free blocks it stands for:
        # a block taken out of turn (_take's `after`) leaves a stale heap entry that the set tells apart.
        self._free = list(range(1, num_blocks + 1))
        self._free_set = set(self._free)
        self._refs = [0] * (num_blocks + 1)  # sequences holding each block
        self.prefix_index = PrefixIndex() if enable_prefix_caching else None
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # tokens written so far per sequence
        self._chains: dict[int, list[int]] = {}  # per sequence: index entries of its leading full blocks
        self._roots: dict[int, int] = {}  # per sequence: the parent of its first block (PrefixIndex.root)
        self._next_id = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: free ones and cached ones no sequence holds."""
        cached = self.prefix_index.num_evictable if self.prefix_index else 0
        return len(self._free_set) + cached

    def allocate(self, namespace: str | None = None) -> int:
        """A new, empty sequence; its id indexes block_tables and lengths. `namespace` (a LoRA adapter) keeps its
        cached prefixes apart: equal tokens through different adapters hold different keys and values."""
        seq_id = self._next_id
        self._next_id += 1
        self.block_tables[seq_id], self.lengths[seq_id], self._chains[seq_id] = [], 0, []
        if self.prefix_index is not None:
            self._roots[seq_id] = self.prefix_index.root(namespace)
        return seq_id

    def free(self, seq_id: int) -> None:
        self.check_allocated(seq_id)
        for block in reversed(self.block_tables.pop(seq_id)):  # a chain's tail becomes the first to evict
            self._drop(block)
        del self.lengths[seq_id], self._chains[seq_id]
        self._roots.pop(seq_id, None)

    def reuse_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """Give a new sequence the cached blocks its tokens start with; returns the tokens they hold.

        Only full blocks below the last token count: its logits are what the first forward computes."""
        table = self.block_tables[seq_id]
        if table:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if self.prefix_index is None:
            return 0
        size, parent = self.block_size, self._roots[seq_id]
        for start in range(0, len(token_ids) - 1 - size + 1, size):
            entry = self.prefix_index.find(parent, token_ids[start : start + size])
            if entry is None:
                break
            self._hold_indexed(entry.block)
            table.append(entry.block)
            self._chains[seq_id].append(entry.id)
            parent = entry.id
        self.lengths[seq_id] = len(table) * size
        self.prefix_index.record_query(len(token_ids), len(table) * size)
        return len(table) * size

    def cache_prefix(self, seq_id: int, token_ids: list[int], num_tokens: int) -> None:
        """Index the sequence's full blocks below `num_tokens`; `token_ids[:num_tokens]` is what they hold, and
        the caller promises never to write below `num_tokens` again."""
        if self.prefix_index is None:
            return
        table, chain, size = self.block_tables[seq_id], self._chains[seq_id], self.block_size
        for i in range(len(chain), min(num_tokens // size, len(table))):
            parent = chain[-1] if chain else self._roots[seq_id]
            entry = self.prefix_index.add(parent, token_ids[i * size : (i + 1) * size], table[i])
            if entry.block != table[i]:  # computed beside an equal block that was indexed first: share that one
                self._hold_indexed(entry.block)
                self._drop(table[i])
                table[i] = entry.block
            chain.append(entry.id)

    def cached_tokens(self, seq_id: int) -> int:
        """Tokens at the head of the sequence that sit in indexed blocks: never written again."""
        return len(self._chains[seq_id]) * self.block_size

    def clear_prefix_cache(self) -> None:
        """Forget every cached block (a new world: nothing computed before it is trusted). No sequence may
        be allocated."""
        if self.block_tables:
            raise RuntimeError(f"{len(self.block_tables)} sequence(s) still hold blocks")
        if self.prefix_index is not None:
            for block in self.prefix_index.clear():
                self._give_back(block)

    def take_prefix_stats(self) -> tuple[int, int]:
        """(tokens looked up, tokens found) since the last call."""
        return self.prefix_index.take_stats() if self.prefix_index else (0, 0)

    def _hold_indexed(self, block: int) -> None:
        self.prefix_index.hold(block, first=self._refs[block] == 0)
        self._refs[block] += 1

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0 and not (self.prefix_index and self.prefix_index.release(block)):
            self._give_back(block)

    def _give_back(self, block: int) -> None:
        self._free_set.add(block)
        heapq.heappush(self._free, block)

    def _take(self, after: int | None = None) -> int:
        """A block for new tokens: the one after `after` if free (a sequence's blocks in one run of the pool are
        read in place by attention, model/attention.py), else the lowest free one, else the least recently used
        cached one."""
        if after is not None and after + 1 in self._free_set:
            block = after + 1
            if len(self._free) > 2 * len(self._free_set) + 64:  # drop the stale entries now and then
                self._free = sorted(self._free_set)
        else:
            while self._free and self._free[0] not in self._free_set:
                heapq.heappop(self._free)  # taken out of turn earlier
            block = heapq.heappop(self._free) if self._free else self.prefix_index.evict()
        self._free_set.discard(block)
        self._refs[block] = 1
        return block

    def check_allocated(self, seq_id: int) -> None:
        if isinstance(seq_id, bool) or not isinstance(seq_id, Integral):
            raise ValueError(f"sequence id must be an integer, got {type(seq_id).__name__}")
        if seq_id not in self.block_tables:
            raise ValueError(f"sequence {seq_id} is not allocated")

    def fit(self, seq_id: int, length: int) -> None:
        """Hold exactly the blocks `length` tokens need: free trailing blocks past it, take new ones up to it."""
        table = self.block_tables[seq_id]
        needed = blocks_for(length, self.block_size)
        if needed * self.block_size < self.cached_tokens(seq_id):
            raise RuntimeError(f"sequence {seq_id} cannot shrink below its cached blocks")
        while len(table) > needed:
            self._drop(table.pop())
        if needed - len(table) > self.num_free_blocks:
            raise RuntimeError(
                f"KV cache is out of blocks: sequence {seq_id} needs {needed - len(table)} more block(s) of "
                f"{self.block_size} tokens, {self.num_free_blocks} of {self.num_blocks} are free"
            )
        new = []
        for _ in range(needed - len(table)):
            new.append(self._take(after=(new or table or [None])[-1]))
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

    def write_features(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Store the features of the tokens at flat pool indices `index` ([tokens], as `write` takes)."""
        self.features[index] = rows

    def read_features(self, seq_id: int, end: int) -> torch.Tensor:
        """The features of positions [0, end) of a sequence: [end, feature_dim]."""
        index = torch.tensor(self.token_index(seq_id, 0, end), dtype=torch.long, device=self.features.device)
        return self.features[index]

    def _zero_blocks_below(self, end: int) -> None:
        if end <= self._zeroed:
            return
        end = min(self.num_blocks + 1, max(end, self._zeroed + _ZERO_AHEAD))  # a few ops per many blocks
        for cache in (*self.k, *self.v):
            cache[:, self._zeroed : end].zero_()
        self._zeroed = end


@dataclass(frozen=True)
class PrefixEntry:
    id: int  # never reused: a chain that names an evicted entry finds nothing
    block: int


class PrefixIndex:
    """Cached full blocks by content: (the entry of the block before, the block's tokens) -> entry."""

    ROOT = 0  # the parent of a sequence's first block (the base model's; each LoRA adapter has its own root)

    def __init__(self) -> None:
        self._roots: dict[str, int] = {}
        self._entries: dict[tuple[int, tuple[int, ...]], PrefixEntry] = {}
        self._keys: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> its key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # indexed, held by no sequence; oldest first
        self._ids = itertools.count(self.ROOT + 1)
        self._queried = self._hit = 0

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def root(self, namespace: str | None) -> int:
        """The parent of the first block of a sequence in `namespace` (None: ROOT)."""
        if namespace is None:
            return self.ROOT
        if namespace not in self._roots:
            self._roots[namespace] = next(self._ids)
        return self._roots[namespace]

    def find(self, parent: int, tokens: list[int]) -> PrefixEntry | None:
        return self._entries.get((parent, tuple(tokens)))

    def add(self, parent: int, tokens: list[int], block: int) -> PrefixEntry:
        """Index `block`; if an equal block is indexed already, that entry (the block stays unindexed)."""
        key = (parent, tuple(tokens))
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = PrefixEntry(next(self._ids), block)
            self._keys[block] = key
        return entry

    def hold(self, block: int, first: bool) -> None:
        """A sequence takes an indexed block (`first`: no sequence held it, so it was evictable)."""
        if first:
            del self._evictable[block]

    def release(self, block: int) -> bool:
        """The last sequence let go of `block`: keep it as evictable if indexed (True), else False."""
        if block not in self._keys:
            return False
        self._evictable[block] = None
        return True

    def evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        del self._entries[self._keys.pop(block)]
        return block

    def clear(self) -> list[int]:
        """Forget everything; returns the evictable blocks (now plain free blocks)."""
        blocks = list(self._evictable)
        self._entries.clear(), self._keys.clear(), self._evictable.clear()
        return blocks

    def record_query(self, num_tokens: int, num_hit: int) -> None:
        self._queried += num_tokens
        self._hit += num_hit

    def take_stats(self) -> tuple[int, int]:
        stats, (self._queried, self._hit) = (self._queried, self._hit), (0, 0)
        return stats
