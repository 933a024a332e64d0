"""ModelRunner: loads a checkpoint, owns the KV cache, runs mixed variable-length batches.

``forward`` = ``prepare`` (validate on the host, flatten into a ForwardBatch of plain tensors) +
``execute`` (the model pass). Under tensor parallelism every rank prepares and runs the same batch
itself: the verifier forwards each step's plan to its ranks, not the batch.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from minedraft.config import check_fits_one_request
from minedraft.extras import require
from minedraft.model.attention import plan_attention
from minedraft.model.checkpoint import CheckpointReader, resolve_checkpoint_dir
from minedraft.model.config import ModelConfig, load_model_config
from minedraft.model.eagle import EAGLE, EagleHead, eagle_head_kind
from minedraft.model.graphs import CudaGraphs, StaticForward
from minedraft.model.kv_cache import NULL_BLOCK, KVCache, blocks_for, bytes_per_block, kv_budget_bytes
from minedraft.model.layers import quantized_linears
from minedraft.model.lora import LoraManager, LoraOptions
from minedraft.model.parallel import TensorParallel
from minedraft.model.tokenizer import Tokenizer, load_tokenizer
from minedraft.model.transformer import CausalLM, ForwardContext

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_HALF = (torch.bfloat16, torch.float16)
log = logging.getLogger(__name__)
DEFAULT_BLOCK_SIZE = 16


@dataclass
class SeqInput:
    slot: int  # the sequence's id in the KV cache (allocate_slot)
    token_ids: list[int]  # tokens to write into the cache starting at start_pos
    start_pos: int  # tokens already valid in the cache; later ones are overwritten (rollback = smaller start_pos)
    num_logits: int = 1  # logits for the last num_logits tokens (k + 1 when verifying k drafts; 0: none)
    hidden: torch.Tensor | None = None  # an EAGLE head's hidden input, one row per token ([tokens, hidden])


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
    def __init__(self, path: str | Path, *, max_seq_len: int, num_slots: int = 1, device: str = "cpu",
                 dtype: torch.dtype | str = torch.float32, tp_group: dist.ProcessGroup | None = None,
                 batch_invariant: bool = False, block_size: int = DEFAULT_BLOCK_SIZE,
                 kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float | None = None,
                 attention_kernel: str = "auto", load_format: str = "auto",
                 enable_prefix_caching: bool = False, enforce_eager: bool = False,
                 quantized_kernel: str = "auto", aux_hidden_layers: tuple[int, ...] = (),
                 target_path: str | Path | None = None, fused_kernels: str = "auto",
                 lora: LoraOptions | None = None) -> None:
        """batch_invariant: fixed-shape kernels so logits never depend on the batch (strict, slower).
        num_slots: most sequences held at once; the KV pool never outgrows num_slots x max_seq_len.
        kv_cache_memory_bytes / gpu_memory_utilization: the KV pool's budget (see kv_cache.kv_budget_bytes).
        attention_kernel: torch, triton (paged: reads the cache in place) or auto (triton on CUDA where it is
        installed and the shapes suit it, torch elsewhere).
        load_format: auto (the checkpoint's safetensors) or dummy (random weights from config.json alone, as
        vLLM's --load-format dummy: for timing a model's shape without its weights).
        enable_prefix_caching: keep full blocks of committed tokens for later sequences that start with them
        (see kv_cache.py).
        enforce_eager: no CUDA graphs (model/graphs.py); without it they are captured on CUDA where the paged
        kernel runs a dense model on one rank.
        quantized_kernel: for a quantized checkpoint, triton (keep the weights as stored, MoE experts
        included, Triton GEMMs: model/triton_quant.py, model/triton_moe.py), dequantize (dense weights at
        load) or auto (triton on CUDA where it is installed and the block or group shape suits its tiles,
        dequantize elsewhere).
        aux_hidden_layers: a target that feeds an EAGLE head keeps, after every forward, these hidden states
        for every token (`aux_hidden`), CUDA graphs included, counted as transformers' output_hidden_states
        counts them: i < num_hidden_layers the residual stream entering layer i (EAGLE-3), num_hidden_layers
        the last one after the final norm (EAGLE-1).
        target_path: the model is an EAGLE head (model/eagle.py) of the target there, whose tokenizer it uses
        and whose embedding (an EAGLE-1 head: and LM head) it reads where its own checkpoint has none.
        fused_kernels: the layers' norms (with the residual add), rotary embedding (with the KV write) and
        SiLU-and-mul as Triton kernels (model/triton_fused.py): on, off, or auto (on with CUDA in the default
        mode where triton is installed; never in the strict mode, nor for an EAGLE head).
        lora: the LoRA adapters a sequence may name (SeqInput.lora), applied in batches (model/lora.py); the
        forward runs eagerly (no CUDA graphs) with them unless they run as Triton kernels (model/triton_lora.py)."""
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format {load_format!r}: use auto or dummy")
        self.load_format = load_format
        for setting, kernel in (("attention_kernel", attention_kernel), ("quantized_kernel", quantized_kernel)):
            if kernel == "triton":
                require("triton", f"{setting} triton")
        self._work = (0, 0)  # forwards and tokens since take_work
        self.path = resolve_checkpoint_dir(path)
        self.config: ModelConfig = load_model_config(self.path)
        if self.config.is_eagle3 and target_path is None:
            raise ValueError(f"{self.path} is an EAGLE-3 head: use it with method eagle3 (it runs beside its target)")
        self.target_path = resolve_checkpoint_dir(target_path) if target_path is not None else None
        self.head_kind = self._head_kind()
        self.tokenizer: Tokenizer = load_tokenizer(self.target_path or self.path)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device, self.config)
        self.tp = TensorParallel.from_group(tp_group)
        self.batch_invariant = batch_invariant
        self.max_seq_len = max_seq_len
        self.quantized_kernels = self._use_quantized_kernels(quantized_kernel)
        self.lora: LoraManager | None = None
        self.slot_adapters: dict[int, str] = {}  # the LoRA adapter each sequence's tokens go through
        self.model = self._load_model(lora)  # first: on CUDA the KV budget is what the weights leave
        self.aux_hidden_layers = self._keep_aux_hidden(aux_hidden_layers)
        self.head_hidden: torch.Tensor | None = None  # an EAGLE head's output at the last forward's logits rows
        kv_heads = max(1, self.config.num_key_value_heads // self.tp.size)
        # A target feeding an EAGLE head caches the head's features with its keys and values, so that a request
        # reusing cached blocks still hands the drafter the features of every position.
        feature_dim = self.feature_width if enable_prefix_caching else 0
        per_block = bytes_per_block(self.config.num_hidden_layers, kv_heads, self.config.head_dim, block_size,
                                    self.dtype, feature_dim)
        if self.device.type == "cuda":  # what loading freed (dequantized fallbacks) is not the weights'
            torch.cuda.empty_cache()
        budget, source = kv_budget_bytes(self.device, kv_cache_memory_bytes, gpu_memory_utilization)
        num_blocks = self._agree(min(budget // per_block, num_slots * blocks_for(max_seq_len, block_size)))
        check_fits_one_request(num_blocks, block_size, max_seq_len, f"{source}; {per_block} bytes per block")
        self.kv_cache = KVCache(
            num_layers=self.config.num_hidden_layers, num_blocks=num_blocks, block_size=block_size,
            num_kv_heads=kv_heads, head_dim=self.config.head_dim, dtype=self.dtype, device=self.device,
            enable_prefix_caching=enable_prefix_caching, feature_dim=feature_dim,
        )
        self.paged_kernel = self._use_triton(attention_kernel)
        self.fused_kernels = self._use_fused(fused_kernels)
        if self.fused_kernels:  # before the graphs capture the forward
            self.model.model.fused_kernels = True
        eager = enforce_eager or self.head_kind is not None or (self.lora is not None and not self.lora.kernel)
        self.graphs: StaticForward | None = None if eager else self._capture_graphs()

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

    def _use_triton(self, kernel: str) -> bool:
        if kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_kernel {kernel!r}: use auto, torch or triton")
        if kernel == "torch" or (kernel == "auto" and (self.device.type != "cuda" or self.batch_invariant)):
            return False
        try:
            from minedraft.model.triton_attention import supports
        except ImportError as exc:
            if kernel == "triton":
                raise ValueError(f"attention_kernel triton needs the triton package: {exc}") from exc
            return False
        if kernel == "triton" and self.batch_invariant:
            raise ValueError("attention_kernel triton is not batch-invariant: use torch with batch_invariant")
        return kernel == "triton" or supports(self.kv_cache.block_size, self.config.head_dim)

    def _use_fused(self, kernel: str) -> bool:
        if kernel not in ("auto", "on", "off"):
            raise ValueError(f"fused_kernels {kernel!r}: use auto, on or off")
        if kernel == "on" and self.batch_invariant:
            raise ValueError("fused_kernels on is not for the strict mode (batch_invariant), which keeps torch's ops")
        if kernel == "off" or self.batch_invariant or self.head_kind is not None:
            return False
        if kernel == "auto" and self.device.type != "cuda":
            return False
        try:
            import minedraft.model.triton_fused  # noqa: F401
        except ImportError as exc:
            if kernel == "on":
                raise ValueError(f"fused_kernels on needs the triton package: {exc}") from exc
            return False
        return True

    def _use_quantized_kernels(self, kernel: str) -> bool:
        if kernel not in ("auto", "triton", "dequantize"):
            raise ValueError(f"quantized_kernel {kernel!r}: use auto, triton or dequantize")
        quant = self.config.quantization
        if quant is None or kernel == "dequantize" or (kernel == "auto" and self.device.type != "cuda"):
            return False
        try:
            from minedraft.model.triton_quant import supports_awq, supports_fp8
        except ImportError as exc:
            if kernel == "triton":
                raise ValueError(f"quantized_kernel triton needs the triton package: {exc}") from exc
            return False
        return kernel == "triton" or (supports_fp8(quant.block) if quant.method == "fp8" else
                                      supports_awq(quant.group_size))

    def _head_kind(self) -> str | None:
        """With target_path: the head's kind (model/eagle.py), which its folder must show. Without: None, and
        never a head (an EAGLE-1 head's config.json is a plain LlamaConfig: its weights tell)."""
        if self.target_path is None:
            if self.load_format == "auto" and eagle_head_kind(self.path, self.config) == EAGLE:
                raise ValueError(f"{self.path} is an EAGLE-1 head: use it with method eagle (it runs beside its "
                                 "target)")  # fmt: skip
            return None
        if self.load_format == "dummy" and not self.config.is_eagle3:
            return EAGLE  # no weights to tell: a LlamaConfig beside a target is an EAGLE-1 head
        kind = eagle_head_kind(self.path, self.config)
        if kind is None:
            raise ValueError(f"{self.path} is not an EAGLE head: its checkpoint has no fc.weight (or has a model.* "
                             "decoder, as a draft model does)")  # fmt: skip
        return kind

    def _load_model(self, lora: LoraOptions | None) -> CausalLM | EagleHead:
        if self.head_kind is not None:
            if lora is not None:
                raise ValueError(f"{self.path} is an EAGLE head: LoRA adapters are for a target or a draft model")
            return self._load_head()
        quant = self.config.quantization if self.quantized_kernels else None
        with torch.device(self.device), _default_dtype(self.dtype), quantized_linears(quant):
            model = CausalLM(self.config, self.max_seq_len, self.tp, self.batch_invariant)
        if self.load_format == "dummy":
            _random_weights(model)
        else:
            with closing(CheckpointReader(self.path, self.config.quantization)) as reader:
                model.load_weights(reader)
        if lora is not None:  # before packing: the adapters' pools take the dense weights' shapes
            self.lora = LoraManager(model, lora)
        model.pack_weights()
        held, quantized = weight_bytes(model)
        log.info("weights on this rank: %.2f GiB, %.2f GiB of them kept quantized", held / 2**30, quantized / 2**30)
        for reason, layers in Counter(r for m in model.modules() for r in getattr(m, "fallbacks", ())).items():
            log.warning("%s (MoE layers: %d)", reason, layers)
        return model.eval()

    def _load_head(self) -> EagleHead:
        if self.load_format == "dummy":
            return _random_weights(self._new_head(fc_bias=False)).eval()
        with closing(CheckpointReader(self.path)) as reader, closing(CheckpointReader(self.target_path)) as target:
            head = self._new_head(fc_bias="fc.bias" in reader)
            head.load_weights(reader, target)
        return head.eval()

    def _new_head(self, fc_bias: bool) -> EagleHead:
        with torch.device(self.device), _default_dtype(self.dtype):
            return EagleHead(self.config, self.max_seq_len, self.tp, self.batch_invariant, self.head_kind, fc_bias)

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
        batch = self.prepare(seqs)
        logits = self.execute(batch)
        if self.kv_cache.features is not None and len(batch.token_index):
            self.kv_cache.write_features(batch.token_index.to(self.device), self.aux_hidden)
        for seq in seqs:
            self.kv_cache.lengths[seq.slot] = seq.start_pos + len(seq.token_ids)
        self._work = (self._work[0] + 1, self._work[1] + sum(len(seq.token_ids) for seq in seqs))
        return logits

    def take_work(self) -> tuple[int, int]:
        """(forwards, tokens) run since the last call: what a step's seconds paid for."""
        work, self._work = self._work, (0, 0)
        return work

    def prepare(self, seqs: list[SeqInput]) -> ForwardBatch:
        """Validate the batch, fit each sequence's blocks to what it will hold, flatten into host tensors."""
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
        width = max((len(t) for t in tables), default=0)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
        return ForwardBatch(as_tensor(ids), as_tensor(positions), as_tensor(index),
                            as_tensor([s.start_pos for s in seqs]), as_tensor(lens), as_tensor(logits_indices),
                            as_tensor([t + [NULL_BLOCK] * (width - len(t)) for t in tables]).view(len(seqs), width),
                            self._head_inputs(seqs), self._lora_slots(seqs, lens))  # fmt: skip

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
                              self.kv_cache.k[0].shape[0], self.device, self.batch_invariant, self.paged_kernel)
        batch = batch.to(self.device)
        ctx = ForwardContext(positions=batch.positions, token_index=batch.token_index, attention=plan,
                             kv_cache=self.kv_cache)
        if self.lora is not None:
            self.lora.tokens.set(batch.lora_slots)
        if isinstance(self.model, EagleHead):
            logits, self.head_hidden = self.model(batch.input_ids, ctx, batch.logits_indices, batch.hidden)
            return logits
        return self.model(batch.input_ids, ctx, batch.logits_indices).float()


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the weights a model holds as they are stored, bytes of those kept quantized): parameters,
    oneDNN-packed copies, and the quantized storage of linear layers and MoE experts (QuantizedWeight)."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    quantized = 0
    for module in model.modules():
        held = getattr(module, "quantized", None)  # LinearBase: one or None; StackedExperts: a dict
        for stored in held.values() if isinstance(held, dict) else () if held is None else (held,):
            quantized += stored.nbytes
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor):
            dense += packed.numel() * packed.element_size()
    return dense + quantized, quantized


@torch.no_grad()
def _random_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Matrices ~ N(0, 0.02), norm weights 1: activations stay in range, so timings are those of real weights."""
    for param in model.parameters():
        if param.dim() >= 2:
            param.normal_(0.0, 0.02)
        else:
            param.fill_(1.0)
    return model


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
