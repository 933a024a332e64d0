"""CUDA graphs for decode and verification steps: one graph per token-count bucket.

A decode or verification step runs the same few hundred kernels every time with only its inputs changed,
and on a GPU launching them can cost more than running them. As vLLM does, the runner captures the whole
forward once per bucket of token counts (1, 2, 4, 8, ... up to `max_tokens`) at start-up and replays it:
the step's inputs are copied into the bucket's static buffers, padded to its size, and the graph runs.

Padding must not change any real token's result:

- tokens past the real ones are token 0 at position 0; they write their keys and values to the pool's
  scratch block (KVCache.scratch_block), which no sequence reads, and belong to no sequence;
- sequences past the real ones have no tokens and no blocks (their programs in the paged kernel exit);
- logits rows past the real ones read token 0's row and are dropped.

A target that feeds an EAGLE head also has the head's features captured (EAGLE-3: its states of three
layers; EAGLE-1: its final normed state): each bucket keeps the buffer its replays write them to, and a step
reads the rows of its real tokens.

With LoRA adapters run by the Triton kernels (model/kernels/triton_lora.py), each bucket also keeps each token's
adapter slot in a buffer the captured kernels read; padding tokens are in slot 0 (no adapter). The
adapters' weights sit in fixed pools that loading an adapter overwrites in place, so a replay applies
whatever adapters the step's tokens name.

Only steps the static shapes cover use a graph: the paged (Triton) attention kernel, dense models (MoE
routing has data-dependent shapes), at most `max_tokens` tokens, and every sequence's query at most
`MAX_QUERY` tokens (k + 1 verification tokens; a prefill chunk is longer and runs eagerly). Everything else
runs eagerly, as does everything with `enforce_eager`.

`StaticForward` is the padded forward without a graph: the CPU tests run it (the paged kernel under
Triton's interpreter) against the eager forward, which checks the padding rules above. `CudaGraphs` adds
capture and replay and needs a CUDA device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minedraft.model.attention import AttentionPlan
from minedraft.model.kv_cache import NULL_BLOCK, KVCache

MAX_QUERY = 16  # query tokens per sequence a graph's kernel grid covers (k + 1 with k up to 15)
DEFAULT_MAX_TOKENS = 512


def capture_sizes(max_tokens: int) -> list[int]:
    """Buckets of token counts: 1, 2, 4, 8, then every 8 up to 64, every 32 up to 256, every 64 after."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(96, 257, 32), *range(320, max(max_tokens, 320) + 1, 64)]
    return [s for s in sizes if s < max_tokens] + [max_tokens]


def pick_bucket(sizes: Sequence[int], num_tokens: int) -> int | None:
    """The smallest bucket that holds `num_tokens` (sizes ascending), or None: run eagerly."""
    return next((size for size in sizes if size >= num_tokens), None)


@dataclass
class StaticBuffers:
    """One bucket's inputs at fixed shapes, on the device; filled in place before every run."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    token_index: torch.Tensor  # [tokens] int64 flat cache index
    logits_indices: torch.Tensor  # [tokens] int64
    block_tables: torch.Tensor  # [tokens, width] int32 (one sequence per token at most)
    starts: torch.Tensor  # [tokens] int32
    query_starts: torch.Tensor  # [tokens + 1] int32
    lora_slots: torch.Tensor  # [tokens] int64 each token's LoRA adapter slot (0: none)

    @classmethod
    def allocate(cls, tokens: int, width: int, device: torch.device) -> StaticBuffers:
        longs = {"dtype": torch.int64, "device": device}
        ints = {"dtype": torch.int32, "device": device}
        return cls(torch.zeros(tokens, **longs), torch.zeros(tokens, **longs), torch.zeros(tokens, **longs),
                   torch.zeros(tokens, **longs), torch.full((tokens, width), NULL_BLOCK, **ints),
                   torch.zeros(tokens, **ints), torch.zeros(tokens + 1, **ints),
                   torch.zeros(tokens, **longs))  # fmt: skip

    def fill(self, batch, scratch_slot: int) -> None:
        """Copy a ForwardBatch in and pad the rest (see the module docstring); `batch` is on the host."""
        tokens, seqs, rows = len(batch.input_ids), len(batch.start_pos), len(batch.logits_indices)
        pad = self.input_ids.shape[0] - tokens
        host = lambda real, value: torch.cat((real, torch.full((pad,), value, dtype=torch.int64)))  # noqa: E731
        self.input_ids.copy_(host(batch.input_ids, 0), non_blocking=True)
        self.positions.copy_(host(batch.positions, 0), non_blocking=True)
        self.token_index.copy_(host(batch.token_index, scratch_slot), non_blocking=True)
        self.logits_indices.copy_(torch.cat((batch.logits_indices, torch.zeros(self.input_ids.shape[0] - rows,
                                                                               dtype=torch.int64))), non_blocking=True)
        tables = torch.full(self.block_tables.shape, NULL_BLOCK, dtype=torch.int32)
        tables[:seqs, : batch.block_tables.shape[1]] = batch.block_tables
        self.block_tables.copy_(tables, non_blocking=True)
        starts = torch.zeros(self.starts.shape, dtype=torch.int32)
        starts[:seqs] = batch.start_pos
        self.starts.copy_(starts, non_blocking=True)
        query_starts = torch.full(self.query_starts.shape, tokens, dtype=torch.int32)
        query_starts[0] = 0
        query_starts[1 : seqs + 1] = torch.cumsum(batch.query_lens, 0)
        self.query_starts.copy_(query_starts, non_blocking=True)
        lora = batch.lora_slots if batch.lora_slots is not None else torch.zeros(tokens, dtype=torch.int64)
        self.lora_slots.copy_(host(lora, 0), non_blocking=True)


class StaticForward:
    """The padded forward of one bucket at a time, without a graph (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, max_seq_len: int, device: torch.device,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.sizes = capture_sizes(max_tokens)
        self.max_seq_len = max_seq_len
        self.width = -(-max_seq_len // kv_cache.block_size)
        self.scratch_slot = kv_cache.scratch_block * kv_cache.block_size
        self.buffers: dict[int, StaticBuffers] = {}
        # The adapters' per-token slots (lora.TokenSlots, shared by the model's adapted layers), if any.
        self.lora_tokens = next((m.lora.tokens for m in model.modules() if getattr(m, "lora", None) is not None),
                                None)  # fmt: skip

    def fits(self, batch) -> bool:
        """Whether the step's shapes are ones a bucket covers (the batch is on the host)."""
        return (pick_bucket(self.sizes, len(batch.input_ids)) is not None and len(batch.query_lens) > 0
                and int(batch.query_lens.max()) <= MAX_QUERY)  # fmt: skip

    def run(self, batch) -> torch.Tensor:
        """Logits of the batch's rows, through its bucket's static buffers."""
        size = pick_bucket(self.sizes, len(batch.input_ids))
        buffers = self._buffers(size)
        buffers.fill(batch, self.scratch_slot)
        logits = self._forward(size, buffers)[: len(batch.logits_indices)]
        decoder = self.model.model
        if decoder.aux_layers:  # a target feeding an EAGLE head: the features of the real tokens (the first rows)
            decoder.aux_hidden = self._aux_output(size)[: len(batch.input_ids)].clone()
        return logits

    def _aux_output(self, size: int) -> torch.Tensor:
        return self.model.model.aux_hidden

    def _buffers(self, size: int) -> StaticBuffers:
        if size not in self.buffers:
            self.buffers[size] = StaticBuffers.allocate(size, self.width, self.device)
        return self.buffers[size]

    def _forward(self, size: int, buffers: StaticBuffers) -> torch.Tensor:
        return self._call_model(buffers)

    def _call_model(self, buffers: StaticBuffers) -> torch.Tensor:
        from minedraft.model.kernels.triton_attention import PagedMeta
        from minedraft.model.transformer import ForwardContext  # transformer imports this module's users

        if self.lora_tokens is not None:  # the adapted layers read each token's slot from the bucket's buffer
            self.lora_tokens.set(buffers.lora_slots)
        meta = PagedMeta(buffers.block_tables, buffers.starts, buffers.query_starts, MAX_QUERY, self.max_seq_len)
        ctx = ForwardContext(positions=buffers.positions, token_index=buffers.token_index,
                             attention=AttentionPlan([], [], paged=meta), kv_cache=self.kv_cache)  # fmt: skip
        return self.model(buffers.input_ids, ctx, buffers.logits_indices).float()


class CudaGraphs(StaticForward):
    """StaticForward with every bucket captured as a CUDA graph at start-up and replayed."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, max_seq_len: int, device: torch.device,
                 max_tokens: int = DEFAULT_MAX_TOKENS, progress: Callable[[int, int], None] | None = None) -> None:
        super().__init__(model, kv_cache, max_seq_len, device, max_tokens)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.aux_outputs: dict[int, torch.Tensor] = {}  # per bucket: the captured aux states' buffer, if any
        self._pool = None
        for done, size in enumerate(sorted(self.sizes, reverse=True)):  # largest first: the others reuse its pool
            self._capture(size)
            if progress is not None:
                progress(done + 1, len(self.sizes))

    def _capture(self, size: int) -> None:
        buffers = self._buffers(size)
        buffers.token_index.fill_(self.scratch_slot)  # an all-padding batch: nothing real is written
        buffers.query_starts.zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            self._call_model(buffers)  # warm-up: Triton compiles, allocators settle, outside the capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
            logits = self._call_model(buffers)
        self._pool = graph.pool()
        self.graphs[size] = (graph, logits)
        if self.model.model.aux_layers:  # replays write this buffer, as they write the logits
            self.aux_outputs[size] = self.model.model.aux_hidden

    def _aux_output(self, size: int) -> torch.Tensor:
        return self.aux_outputs[size]

    def _forward(self, size: int, buffers: StaticBuffers) -> torch.Tensor:
        graph, logits = self.graphs[size]
        graph.replay()
        return logits.clone()  # the next replay writes the same buffer
