"""ModelRunner: loads a checkpoint, owns the KV cache, runs mixed variable-length batches.

``forward`` = ``prepare`` (validate on the host, flatten into a ForwardBatch of plain tensors) +
``execute`` (the model pass). Under tensor parallelism every rank prepares and runs the same batch
itself: the verifier forwards each step's plan to its ranks, not the batch. Loading (the checkpoint read,
weights into the model, quantized or dequantized) is loader.py's; how a runner is set up, RunnerOptions.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from minedraft.config import check_fits_one_request
from minedraft.extras import require
from minedraft.model.attention import plan_attention
from minedraft.model.eagle import EagleHead
from minedraft.model.graphs import CudaGraphs, StaticForward
from minedraft.model.kernels import choice
from minedraft.model.kernels.cpu_stack import DecodeStack, StackStep
from minedraft.model.kv_cache import NULL_BLOCK, KVCache, blocks_for, bytes_per_block, kv_budget_bytes
from minedraft.model.loader import (
    LOAD_FORMATS,
    Checkpoint,
    Placement,
    load_model,
    resolve_dtype,
    use_quantized_kernels,
    weights_in_bf16,
)
from minedraft.model.lora import LoraOptions
from minedraft.model.parallel import TensorParallel
from minedraft.model.tokenizer import Tokenizer, load_tokenizer
from minedraft.model.transformer import CausalLM, ForwardContext

log = logging.getLogger(__name__)
DEFAULT_BLOCK_SIZE = 16
_KERNELS = {"attention_kernel": ("auto", "torch", "triton", "cpu"),
            "quantized_kernel": ("auto", "triton", "dequantize"),
            "fused_kernels": ("auto", "triton", "cpu", "off")}  # fmt: skip


@dataclass(frozen=True)
class RunnerOptions:
    """How a ModelRunner holds its model. The engine's workers set the first group from EngineConfig
    (engine/local_executor.py). The kernel choices and load_format are not engine settings: auto picks the
    kernels for the device and the checkpoint, and the explicit values are for tests and benchmarks that
    compare kernels or time a model's shape without its weights."""

    max_seq_len: int  # the longest sequence, prompt and output
    num_slots: int = 1  # most sequences held at once; the KV pool never outgrows num_slots x max_seq_len
    device: str | torch.device = "cpu"
    dtype: torch.dtype | str = torch.float32  # or auto: float32 on CPU (bf16 values: weights_in_bf16), else half
    tp_group: dist.ProcessGroup | None = None  # the target's tensor-parallel group (never the world group)
    batch_invariant: bool = False  # fixed-shape kernels so logits never depend on the batch (strict, slower)
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per KV-cache block
    # the KV pool's budget, in bytes or as a fraction of a GPU's memory (see kv_cache.kv_budget_bytes)
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    # keep full blocks of committed tokens for later sequences that start with them (see kv_cache.py)
    enable_prefix_caching: bool = False
    # no CUDA graphs (model/graphs.py); without it they are captured on CUDA where the paged kernel runs a
    # dense model on one rank
    enforce_eager: bool = False
    # a target that feeds an EAGLE head keeps, after every forward, these hidden states for every token
    # (`aux_hidden`), CUDA graphs included, counted as transformers' output_hidden_states counts them:
    # i < num_hidden_layers the residual stream entering layer i (EAGLE-3), num_hidden_layers the last one
    # after the final norm (EAGLE-1)
    aux_hidden_layers: tuple[int, ...] = ()
    # the model is an EAGLE head (model/eagle.py) of the target there, whose tokenizer it uses and whose
    # embedding (an EAGLE-1 head: and LM head) it reads where its own checkpoint has none
    target_path: str | Path | None = None
    # the tokenizer to use instead of the checkpoint's own (a folder with tokenizer.json, or the file)
    tokenizer: str | Path | None = None
    # the LoRA adapters a sequence may name (allocate_slot), applied in batches (model/lora.py); the forward
    # runs eagerly (no CUDA graphs) with them unless they run as Triton kernels (model/kernels/triton_lora.py)
    lora: LoraOptions | None = None
    # Test and benchmark knobs. attention_kernel: torch, triton (paged: reads the cache in place), cpu (the
    # C kernel for short queries on CPU, model/kernels/cpu_attention.py) or auto (triton on CUDA where it is installed
    # and the shapes suit it; cpu on CPU for float32 models where a C compiler builds it; torch elsewhere).
    attention_kernel: str = "auto"
    # for a quantized checkpoint: triton (keep the weights as stored, MoE experts included, Triton GEMMs),
    # dequantize (dense weights at load) or auto (loader.use_quantized_kernels)
    quantized_kernel: str = "auto"
    # the layers' norms (with the residual add), rotary embedding (with the KV write) and SiLU-and-mul as fused
    # kernels: triton (model/kernels/triton_fused.py), cpu (C, model/kernels/cpu_fused.py: float32 on CPU), off,
    # or auto (triton with CUDA where triton is installed, cpu on CPU for float32 models where a C compiler builds
    # it; in the default mode only, never in the strict mode, nor for an EAGLE head); with cpu, a step of short
    # queries runs every layer in one C call where the model allows it (model/kernels/cpu_stack.py)
    fused_kernels: str = "auto"
    # auto (the checkpoint's safetensors) or dummy (random weights from config.json alone, as vLLM's
    # --load-format dummy: for timing a model's shape without its weights)
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {self.load_format!r}: use auto or dummy")
        for setting in ("attention_kernel", "quantized_kernel"):
            if getattr(self, setting) == "triton":
                require("triton", f"{setting} triton")
        for setting, choices in _KERNELS.items():
            if getattr(self, setting) not in choices:
                raise ValueError(f"{setting} {getattr(self, setting)!r}: use {', '.join(choices[:-1])} or "
                                 f"{choices[-1]}")  # fmt: skip
        if self.batch_invariant and self.attention_kernel in ("triton", "cpu"):
            raise ValueError(f"attention_kernel {self.attention_kernel} is not the strict mode's kernel: use torch "
                             "with batch_invariant")
        if self.batch_invariant and self.fused_kernels in ("triton", "cpu"):
            raise ValueError(f"fused_kernels {self.fused_kernels} is not for the strict mode (batch_invariant), which "
                             "keeps torch's ops")


@dataclass
class SeqInput:
    slot: int  # the sequence's id in the KV cache (allocate_slot)
    token_ids: list[int]  # tokens to write into the cache starting at start_pos
    start_pos: int  # tokens already valid in the cache; later ones are overwritten (rollback = smaller start_pos)
    num_logits: int = 1  # logits for the last num_logits tokens (k + 1 when verifying k drafts; 0: none)
    hidden: torch.Tensor | None = None  # an EAGLE head's hidden input, one row per token ([tokens, hidden])


class _HostBatch(NamedTuple):
    """A step flattened into host lists (ModelRunner._flatten): what prepare and the one-call stack read."""

    ids: list[int]  # every sequence's new tokens, in batch order
    positions: list[int]
    token_index: list[int]  # each token's flat KV-cache index
    logits_indices: list[int]  # rows of the flattened tokens that need logits
    tables: list[list[int]]  # each sequence's blocks
    starts: list[int]  # each sequence's start_pos
    query_lens: list[int]  # each sequence's new tokens


@dataclass
class ForwardBatch:
    """A flattened batch of plain int64 tensors: everything ``execute`` needs, nothing host-side."""

    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    token_index: torch.Tensor  # [tokens] flat KV-cache index of each token
    start_pos: torch.Tensor  # [seqs]
    query_lens: torch.Tensor  # [seqs]
    logits_indices: torch.Tensor  # [rows] indices into the flattened tokens
    block_tables: torch.Tensor  # [seqs, width] each sequence's blocks, padded with the zero block
    hidden: torch.Tensor | None = None  # [tokens, hidden] an EAGLE head's hidden inputs (float)
    lora_slots: torch.Tensor | None = None  # [tokens] each token's adapter slot (model/lora.py); None: no adapter

    def to(self, device: torch.device | str) -> ForwardBatch:
        moved = (getattr(self, f.name) for f in fields(self))
        return ForwardBatch(*(t if t is None else t.to(device, non_blocking=True) for t in moved))



class ModelRunner:
    def __init__(self, path: str | Path, options: RunnerOptions | None = None, /, **settings: Any) -> None:
        """The model of the checkpoint at `path` (a folder or a hub name), held as `options` say, or as
        RunnerOptions(**settings): ModelRunner(path, max_seq_len=64, num_slots=2)."""
        if options is not None and settings:
            raise TypeError("give RunnerOptions or its fields as keywords, not both")
        self.options = options = options or RunnerOptions(**settings)
        self._work = (0, 0)  # forwards and tokens since take_work
        checkpoint = Checkpoint.open(path, options.target_path, options.load_format)
        self.path, self.config, self.target_path = checkpoint.path, checkpoint.config, checkpoint.target_path
        self.head_kind, self.load_format = checkpoint.head_kind, checkpoint.load_format
        self.tokenizer: Tokenizer = load_tokenizer(options.tokenizer or self.target_path or self.path)
        self.device = torch.device(options.device)
        self.dtype = resolve_dtype(options.dtype, self.device, self.config)
        self.tp = TensorParallel.from_group(options.tp_group)
        self.batch_invariant, self.max_seq_len = options.batch_invariant, options.max_seq_len
        self.quantized_kernels = use_quantized_kernels(self.config, options.quantized_kernel, self.device)
        self.slot_adapters: dict[int, str] = {}  # the LoRA adapter each sequence's tokens go through
        self.weights_bf16 = weights_in_bf16(options.dtype, self.device, self.config)
        placement = Placement(self.device, self.dtype, self.tp, self.max_seq_len, self.batch_invariant,
                              self.weights_bf16)
        # first: on CUDA the KV budget is what the weights leave
        self.model, self.lora = load_model(checkpoint, placement, self.quantized_kernels, options.lora)
        self.aux_hidden_layers = self._keep_aux_hidden(options.aux_hidden_layers)
        self.head_hidden: torch.Tensor | None = None  # an EAGLE head's output at the last forward's logits rows
        self.kv_cache = self._new_kv_cache(options)
        self._choose_kernels(options)
        eager = options.enforce_eager or self.head_kind is not None or (self.lora is not None and not self.lora.kernel)
        self.graphs: StaticForward | None = None if eager else self._capture_graphs()

    def _choose_kernels(self, options: RunnerOptions) -> None:
        """The attention and fused layer kernels (model/kernels/choice.py), in place before the graphs capture the
        forward; a step of short queries as one C call where those run and the model allows it."""
        head_dim, torch_ops = self.config.head_dim, self.batch_invariant or self.head_kind is not None
        self.paged_kernel = choice.triton_attention(options.attention_kernel, self.device, self.batch_invariant,
                                                    self.kv_cache.block_size, head_dim)  # fmt: skip
        self.cpu_kernel = choice.cpu_attention_kernel(options.attention_kernel, self.device, self.dtype,
                                                      self.batch_invariant, head_dim)  # fmt: skip
        self.fused_kernels = choice.fused_layers(options.fused_kernels, self.device, self.dtype, torch_ops)
        if self.fused_kernels is not None:  # the kernels' name, None: torch's ops
            kernels = importlib.import_module(f"minedraft.model.kernels.{self.fused_kernels}_fused")
            self.model.model.fused_kernels = kernels
        stack = choice.decode_stack(self.model, self.fused_kernels, self.cpu_kernel, self.lora is not None)
        self.decode_stack = stack is not None  # whether short-query steps run as one C call
        if stack is not None:
            self.model.model.decode_stack = stack

    def _new_kv_cache(self, options: RunnerOptions) -> KVCache:
        """The paged pool: what its budget holds, never more than num_slots sequences of max_seq_len need, the
        same number of blocks on every tensor-parallel rank."""
        kv_heads = max(1, self.config.num_key_value_heads // self.tp.size)
        # A target feeding an EAGLE head caches the head's features with its keys and values, so that a request
        # reusing cached blocks still hands the drafter the features of every position.
        feature_dim = self.feature_width if options.enable_prefix_caching else 0
        block_size = options.block_size
        per_block = bytes_per_block(self.config.num_hidden_layers, kv_heads, self.config.head_dim, block_size,
                                    self.dtype, feature_dim)
        if self.device.type == "cuda":  # what loading freed (dequantized fallbacks) is not the weights'
            torch.cuda.empty_cache()
        budget, source = kv_budget_bytes(self.device, options.kv_cache_memory_bytes, options.gpu_memory_utilization)
        num_blocks = self._agree(min(budget // per_block, options.num_slots * blocks_for(self.max_seq_len,
                                                                                          block_size)))  # fmt: skip
        check_fits_one_request(num_blocks, block_size, self.max_seq_len, f"{source}; {per_block} bytes per block")
        return KVCache(
            num_layers=self.config.num_hidden_layers, num_blocks=num_blocks, block_size=block_size,
            num_kv_heads=kv_heads, head_dim=self.config.head_dim, dtype=self.dtype, device=self.device,
            enable_prefix_caching=options.enable_prefix_caching, feature_dim=feature_dim,
        )

    def _capture_graphs(self) -> StaticForward | None:
        """CUDA graphs for decode and verification steps, where their static shapes apply (model/graphs.py).
        Not with tensor parallelism: the all-reduce inside a captured graph has not been validated yet."""
        if self.device.type != "cuda" or not self.paged_kernel or self.config.moe_layers or self.tp.size > 1:
            return None
        start = time.perf_counter()
        graphs = CudaGraphs(self.model, self.kv_cache, self.max_seq_len, self.device)
        log.info("captured %d CUDA graphs (decode and verification steps up to %d tokens) in %.1f s",
                 len(graphs.graphs), max(graphs.sizes), time.perf_counter() - start)
        return graphs

    def _keep_aux_hidden(self, layers: tuple[int, ...]) -> tuple[int, ...]:
        layers = tuple(layers)
        if layers:
            if not isinstance(self.model, CausalLM) or self.config.moe_layers:
                raise ValueError("aux_hidden_layers is for a dense target model")
            bad = [i for i in layers if not 0 <= i <= self.config.num_hidden_layers]
            if bad:
                raise ValueError(f"aux_hidden_layers {list(layers)}: {bad} outside the target's hidden states 0 .. "
                                 f"{self.config.num_hidden_layers} (its {self.config.num_hidden_layers} layers' inputs "
                                 "and its final normed state)")  # fmt: skip
            self.model.model.aux_layers = layers
        return layers

    @property
    def aux_hidden(self) -> torch.Tensor | None:
        """After a forward with aux_hidden_layers: [tokens, feature_width], the flattened batch's tokens in order."""
        return self.model.model.aux_hidden if self.aux_hidden_layers else None

    @property
    def feature_width(self) -> int:
        """Values per token of `aux_hidden`."""
        return len(self.aux_hidden_layers) * self.config.hidden_size

    def _agree(self, num_blocks: int) -> int:
        """Tensor-parallel ranks take the same decisions on blocks: all take the smallest rank's pool."""
        if self.tp.size == 1:
            return num_blocks
        value = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.tp.group)
        return int(value.item())

    # Sequences ---------------------------------------------------------------------------------------

    def allocate_slot(self, lora: str | None = None) -> int:
        """A new sequence in the KV cache (it takes blocks as it is written), through LoRA adapter `lora` (a name
        the runner's LoraOptions knows; None: the base model). Its cached prefixes are that adapter's own."""
        if lora is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {lora!r} asked of a model started without LoRA")
            self.lora.check(lora)
        slot = self.kv_cache.allocate(namespace=lora)
        if lora is not None:
            self.slot_adapters[slot] = lora
        return slot

    def serves_lora(self, name: str | None) -> bool:
        return name is not None and self.lora is not None and name in self.lora.options.adapters

    def free_slot(self, slot: int) -> None:
        self.kv_cache.free(slot)
        self.slot_adapters.pop(slot, None)

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    # Forward -----------------------------------------------------------------------------------------

    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """float32 logits [sum(num_logits), vocab_size], rows in seqs order, on the runner's device."""
        stack = self._stack_for(seqs)
        if stack is not None:  # the whole forward as one C call, from the host lists
            logits = stack.logits(StackStep(*self._flatten(seqs)), self.kv_cache)
        else:
            batch = self.prepare(seqs)
            logits = self.execute(batch)
            if self.kv_cache.features is not None and len(batch.token_index):
                self.kv_cache.write_features(batch.token_index.to(self.device), self.aux_hidden)
        for seq in seqs:
            self.kv_cache.lengths[seq.slot] = seq.start_pos + len(seq.token_ids)
        self._work = (self._work[0] + 1, self._work[1] + sum(len(seq.token_ids) for seq in seqs))
        return logits

    def draft_greedy(self, seqs: list[SeqInput], steps: list[int]) -> tuple[list[list[int]], list[list[float]]] | None:
        """Greedy drafting in one call of the stack: each sequence's tokens written and its last one's argmax
        taken, then that token written at the next position and its argmax taken, until sequence i has steps[i]
        tokens (the last one not written). Returns each one's tokens and their softmax probabilities, as
        `forward` and an argmax per token would; None where the stack does not run these steps (the caller
        then runs them one forward at a time)."""
        stack = self._stack_for(seqs)
        if stack is None or any(seq.num_logits != 1 for seq in seqs):
            return None
        ends = [seq.start_pos + len(seq.token_ids) + n - 1 for seq, n in zip(seqs, steps, strict=True)]
        for seq, n, end in zip(seqs, steps, ends):
            if n < 1 or end > self.max_seq_len:
                raise ValueError(f"sequence {seq.slot}: {n} draft tokens must be at least 1 and end within "
                                 f"max_seq_len {self.max_seq_len}")  # fmt: skip
        host = self._flatten(seqs)
        for seq, end in zip(seqs, ends):
            self.kv_cache.fit(seq.slot, end)  # the tables the call reads (host.tables) grow in place
        tokens, confidence = stack.draft_greedy(StackStep(*host), steps, self.kv_cache)
        for seq, end in zip(seqs, ends):
            self.kv_cache.lengths[seq.slot] = end
        self._work = (self._work[0] + max(steps), self._work[1] + len(host.ids) + sum(steps) - len(steps))
        return ([row[:n] for row, n in zip(tokens.tolist(), steps)],
                [row[:n] for row, n in zip(confidence.tolist(), steps)])  # fmt: skip

    def take_work(self) -> tuple[int, int]:
        """(forwards, tokens) run since the last call: what a step's seconds paid for."""
        work, self._work = self._work, (0, 0)
        return work

    def prepare(self, seqs: list[SeqInput]) -> ForwardBatch:
        """Validate the batch, fit each sequence's blocks to what it will hold, flatten into host tensors."""
        ids, positions, index, logits_indices, tables, starts, lens = self._flatten(seqs)
        width = max((len(t) for t in tables), default=0)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
        return ForwardBatch(as_tensor(ids), as_tensor(positions), as_tensor(index), as_tensor(starts),
                            as_tensor(lens), as_tensor(logits_indices),
                            as_tensor([t + [NULL_BLOCK] * (width - len(t)) for t in tables]).view(len(seqs), width),
                            self._head_inputs(seqs), self._lora_slots(seqs, lens))  # fmt: skip

    def _flatten(self, seqs: list[SeqInput]) -> _HostBatch:
        """Validate the batch, fit each sequence's blocks to what it will hold, flatten into host lists."""
        seen: set[int] = set()
        for seq in seqs:
            self._validate(seq, seen)
        self._fit_blocks(seqs)
        ids = [t for seq in seqs for t in seq.token_ids]
        positions = [seq.start_pos + i for seq in seqs for i in range(len(seq.token_ids))]
        index = [i for seq in seqs for i in self.kv_cache.token_index(seq.slot, seq.start_pos,
                                                                     seq.start_pos + len(seq.token_ids))]
        lens = [len(seq.token_ids) for seq in seqs]
        logits_indices, end = [], 0
        for seq, n in zip(seqs, lens, strict=True):
            end += n
            logits_indices.extend(range(end - seq.num_logits, end))
        tables = [self.kv_cache.block_tables[seq.slot] for seq in seqs]
        return _HostBatch(ids, positions, index, logits_indices, tables, [s.start_pos for s in seqs], lens)

    def _stack_for(self, seqs: list[SeqInput]) -> DecodeStack | None:
        """The one-call stack where it runs this step (short queries only, no EAGLE features), else None."""
        stack = self.model.model.decode_stack if self.decode_stack else None
        if stack is None or self.model.model.aux_layers or self.kv_cache.features is not None:
            return None
        return stack if DecodeStack.takes([len(seq.token_ids) for seq in seqs]) else None

    def _lora_slots(self, seqs: list[SeqInput], lens: list[int]) -> torch.Tensor | None:
        """Each token's adapter slot, the batch's adapters loaded into slots first (None: no adapter)."""
        names = [self.slot_adapters.get(seq.slot) for seq in seqs]
        if self.lora is None or not any(names):
            return None
        slots = self.lora.activate(names)
        return torch.tensor(slots, dtype=torch.int64).repeat_interleave(torch.tensor(lens, dtype=torch.int64))

    def _head_inputs(self, seqs: list[SeqInput]) -> torch.Tensor | None:
        """An EAGLE head's hidden inputs, one row per token in batch order (every input brings them)."""
        if self.head_kind is None:
            return None
        for seq in seqs:
            if seq.hidden is None or tuple(seq.hidden.shape) != (len(seq.token_ids), self.config.hidden_size):
                got = None if seq.hidden is None else tuple(seq.hidden.shape)
                raise ValueError(f"sequence {seq.slot}: an EAGLE head needs hidden inputs of shape "
                                 f"({len(seq.token_ids)}, {self.config.hidden_size}), got {got}")  # fmt: skip
        return torch.cat([seq.hidden.to(self.device) for seq in seqs]) if seqs else None

    def _fit_blocks(self, seqs: list[SeqInput]) -> None:
        """Rolled-back sequences give their trailing blocks back before growing ones take theirs."""
        ends = {seq.slot: seq.start_pos + len(seq.token_ids) for seq in seqs}
        held = lambda slot: len(self.kv_cache.block_tables[slot])  # noqa: E731
        for slot in sorted(ends, key=lambda s: blocks_for(ends[s], self.kv_cache.block_size) - held(s)):
            self.kv_cache.fit(slot, ends[slot])

    def _validate(self, seq: SeqInput, seen: set[int]) -> None:
        self.kv_cache.check_allocated(seq.slot)
        if seq.slot in seen:
            raise ValueError(f"sequence {seq.slot} appears twice in one batch")
        seen.add(seq.slot)
        n, written = len(seq.token_ids), self.kv_cache.lengths[seq.slot]
        if n == 0:
            raise ValueError(f"sequence {seq.slot}: token_ids is empty")
        if not 0 <= seq.start_pos <= written:
            raise ValueError(
                f"sequence {seq.slot}: start_pos {seq.start_pos} must be in [0, {written}] (tokens already in the "
                "cache)"
            )
        if seq.start_pos < self.kv_cache.cached_tokens(seq.slot):
            raise ValueError(
                f"sequence {seq.slot}: start_pos {seq.start_pos} would overwrite its cached prefix of "
                f"{self.kv_cache.cached_tokens(seq.slot)} tokens"
            )
        if seq.start_pos + n > self.max_seq_len:
            raise ValueError(
                f"sequence {seq.slot}: start_pos {seq.start_pos} + {n} tokens exceeds max_seq_len {self.max_seq_len}"
            )
        if not 0 <= seq.num_logits <= n:
            raise ValueError(f"sequence {seq.slot}: num_logits {seq.num_logits} must be in [0, {n}]")
        low, high = min(seq.token_ids), max(seq.token_ids)
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"sequence {seq.slot}: token id {bad} is outside the vocabulary [0, {self.config.vocab_size})"
            )

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model on a prepared batch (every TP rank calls this with the same batch)."""
        if len(batch.input_ids) == 0:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        if self.graphs is not None and self.graphs.fits(batch):  # with LoRA only through its Triton kernels
            return self.graphs.run(batch)
        # Host lists first: the attention plan is bookkeeping, and this avoids device syncs.
        plan = plan_attention(batch.start_pos.tolist(), batch.query_lens.tolist(), batch.block_tables.tolist(),
                              self.kv_cache.block_size, self.config.num_attention_heads // self.tp.size,
                              self.kv_cache.k[0].shape[0], self.device, self.batch_invariant, self.paged_kernel,
                              self.cpu_kernel)
        batch = batch.to(self.device)
        ctx = ForwardContext(positions=batch.positions, token_index=batch.token_index, attention=plan,
                             kv_cache=self.kv_cache)
        if self.lora is not None:
            self.lora.tokens.set(batch.lora_slots)
        if isinstance(self.model, EagleHead):
            logits, self.head_hidden = self.model(batch.input_ids, ctx, batch.logits_indices, batch.hidden)
            return logits
        return self.model(batch.input_ids, ctx, batch.logits_indices).float()
