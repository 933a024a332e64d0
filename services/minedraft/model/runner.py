"""ModelRunner: loads a checkpoint, owns the KV cache, runs mixed variable-length batches.

``forward`` = ``prepare`` (validate on the host, flatten into a ForwardBatch of plain tensors) +
``execute`` (the model pass). Under tensor parallelism every rank prepares and runs the same batch
itself: the verifier forwards each step's plan to its ranks, not the batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from minedraft.model.attention import plan_attention
from minedraft.model.checkpoint import CheckpointReader, resolve_checkpoint_dir
from minedraft.model.config import ModelConfig, load_model_config
from minedraft.model.kv_cache import KVCache
from minedraft.model.parallel import TensorParallel
from minedraft.model.tokenizer import Tokenizer, load_tokenizer
from minedraft.model.transformer import CausalLM, ForwardContext

if TYPE_CHECKING:
    import torch.distributed as dist

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_HALF = (torch.bfloat16, torch.float16)


@dataclass
class SeqInput:
    slot: int  # KV-cache slot of this sequence
    token_ids: list[int]  # tokens to write into the cache starting at start_pos
    start_pos: int  # tokens already valid in the slot; later ones are overwritten (rollback = smaller start_pos)
    num_logits: int = 1  # logits for the last num_logits tokens (k + 1 when verifying k drafts)


@dataclass
class ForwardBatch:
    """A flattened batch of plain int64 tensors: everything ``execute`` needs, nothing host-side."""

    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    slots: torch.Tensor  # [seqs]
    start_pos: torch.Tensor  # [seqs]
    query_lens: torch.Tensor  # [seqs]
    logits_indices: torch.Tensor  # [rows] indices into the flattened tokens

    def to(self, device: torch.device | str) -> ForwardBatch:
        return ForwardBatch(*(getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)))

    def flatten(self) -> torch.Tensor:
        """One int64 tensor ([tokens, seqs, rows] then the fields), e.g. for a single broadcast."""
        sizes = torch.tensor([len(self.input_ids), len(self.slots), len(self.logits_indices)])
        return torch.cat([sizes.to(self.input_ids.device)] + [getattr(self, f.name) for f in fields(self)])

    @classmethod
    def unflatten(cls, flat: torch.Tensor) -> ForwardBatch:
        tokens, seqs, rows = flat[:3].tolist()
        return cls(*flat[3:].split([tokens, tokens, seqs, seqs, seqs, rows]))


class ModelRunner:
    def __init__(self, path: str | Path, *, num_slots: int, max_seq_len: int, device: str = "cpu",
                 dtype: torch.dtype | str = torch.float32, tp_group: dist.ProcessGroup | None = None,
                 batch_invariant: bool = False, slot_regions: int = 1) -> None:
        """batch_invariant: fixed-shape kernels so logits never depend on the batch (strict, slower).
        slot_regions: the batches the engine keeps; each gets its own range of KV-cache slots."""
        self.path = resolve_checkpoint_dir(path)
        self.config: ModelConfig = load_model_config(self.path)
        self.tokenizer: Tokenizer = load_tokenizer(self.path)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device, self.config)
        self.tp = TensorParallel.from_group(tp_group)
        self.batch_invariant = batch_invariant
        self.max_seq_len = max_seq_len
        self.kv_cache = KVCache(
            num_layers=self.config.num_hidden_layers, num_slots=num_slots,
            num_kv_heads=max(1, self.config.num_key_value_heads // self.tp.size), max_seq_len=max_seq_len,
            head_dim=self.config.head_dim, dtype=self.dtype, device=self.device, num_regions=slot_regions,
        )
        self.model = self._load_model()

    def _load_model(self) -> CausalLM:
        with torch.device(self.device), _default_dtype(self.dtype):
            model = CausalLM(self.config, self.max_seq_len, self.tp, self.batch_invariant)
        reader = CheckpointReader(self.path)
        try:
            model.load_weights(reader)
        finally:
            reader.close()
        return model.eval()

    # Slots -------------------------------------------------------------------------------------------

    def allocate_slot(self, region: int = 0) -> int:
        return self.kv_cache.allocate(region)

    def free_slot(self, slot: int) -> None:
        self.kv_cache.free(slot)

    @property
    def num_free_slots(self) -> int:
        return self.kv_cache.num_free_slots

    # Forward -----------------------------------------------------------------------------------------

    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """float32 logits [sum(num_logits), vocab_size], rows in seqs order, on the runner's device."""
        batch = self.prepare(seqs)
        logits = self.execute(batch)
        for seq in seqs:
            self.kv_cache.lengths[seq.slot] = seq.start_pos + len(seq.token_ids)
        return logits

    def prepare(self, seqs: list[SeqInput]) -> ForwardBatch:
        """Validate the batch and flatten it into host tensors."""
        seen: set[int] = set()
        for seq in seqs:
            self._validate(seq, seen)
        ids = [t for seq in seqs for t in seq.token_ids]
        positions = [seq.start_pos + i for seq in seqs for i in range(len(seq.token_ids))]
        lens = [len(seq.token_ids) for seq in seqs]
        logits_indices, end = [], 0
        for seq, n in zip(seqs, lens, strict=True):
            end += n
            logits_indices.extend(range(end - seq.num_logits, end))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
        return ForwardBatch(as_tensor(ids), as_tensor(positions), as_tensor([s.slot for s in seqs]),
                            as_tensor([s.start_pos for s in seqs]), as_tensor(lens), as_tensor(logits_indices))

    def _validate(self, seq: SeqInput, seen: set[int]) -> None:
        self.kv_cache.check_allocated(seq.slot)
        if seq.slot in seen:
            raise ValueError(f"slot {seq.slot} appears twice in one batch")
        seen.add(seq.slot)
        n, written = len(seq.token_ids), self.kv_cache.lengths[seq.slot]
        if n == 0:
            raise ValueError(f"slot {seq.slot}: token_ids is empty")
        if not 0 <= seq.start_pos <= written:
            raise ValueError(
                f"slot {seq.slot}: start_pos {seq.start_pos} must be in [0, {written}] (tokens already in the cache)"
            )
        if seq.start_pos + n > self.max_seq_len:
            raise ValueError(
                f"slot {seq.slot}: start_pos {seq.start_pos} + {n} tokens exceeds max_seq_len {self.max_seq_len}"
            )
        if not 1 <= seq.num_logits <= n:
            raise ValueError(f"slot {seq.slot}: num_logits {seq.num_logits} must be in [1, {n}]")
        low, high = min(seq.token_ids), max(seq.token_ids)
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"slot {seq.slot}: token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model on a prepared batch (every TP rank calls this with the same batch)."""
        if len(batch.logits_indices) == 0:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        # Host lists first: the attention plan is bookkeeping, and this avoids device syncs.
        plan = plan_attention(batch.start_pos.tolist(), batch.query_lens.tolist(), batch.slots.tolist(),
                              self.config.num_attention_heads // self.tp.size, self.kv_cache.k[0].shape[1],
                              self.device, self.batch_invariant)
        batch = batch.to(self.device)
        ctx = ForwardContext(
            positions=batch.positions, token_slots=torch.repeat_interleave(batch.slots, batch.query_lens),
            attention=plan, kv_cache=self.kv_cache,
        )
        return self.model(batch.input_ids, ctx, batch.logits_indices).float()


def resolve_dtype(dtype: torch.dtype | str, device: torch.device, config: ModelConfig) -> torch.dtype:
    """'auto' = float32 on CPU, the checkpoint's half type elsewhere."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        half = _DTYPES.get(str(config.torch_dtype))
        return torch.float32 if device.type == "cpu" else half if half in _HALF else torch.bfloat16
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16, float16 or auto")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {resolved}; use float32, bfloat16 or float16")
    return resolved


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters are created directly in the target dtype (no fp32 copy on the way to a GPU)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
