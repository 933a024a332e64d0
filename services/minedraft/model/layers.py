"""Building blocks: RMSNorm, rotary embedding, tensor-parallel linears, vocab-parallel embedding / LM head.

Every parameter carries a ``weight_loader(param, source, shard_id=None)``: the model loader only maps
checkpoint names to parameters, and the parameter itself knows which part of the tensor this rank reads
(TP shard, q/k/v or gate/up slot of a packed weight).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minedraft.model.config import RopeConfig
from minedraft.model.errors import CheckpointError
from minedraft.model.kernels.cpu_kernels import remembered
from minedraft.model.parallel import TensorParallel
from minedraft.model.quantization import QuantConfig, QuantizedWeight
from minedraft.model.tensor_slice import TensorSlice

# Where one checkpoint tensor goes in a parameter: (dim, offset, length, full, start), see LinearBase._place.
Shard = tuple[int, int, int, int, int]

# The quantization whose weights linear layers built now keep as stored (see quantized_linears).
_QUANTIZED: ContextVar[QuantConfig | None] = ContextVar("quantized_linears", default=None)


class Adapters(Protocol):
    """A linear layer's LoRA adapters (model/lora.py's LoraSlots): their product added to the layer's own."""

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (the layer's x @ W.T, before a row-parallel all-reduce) plus each token's adapter product of x."""
        ...


# Rows per GEMM in batch-invariant mode. Every matmul is issued with this fixed M, so a row's result
# does not depend on how many other rows share the forward pass.
ROW_BLOCK = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, batch_invariant: bool,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias). Batch-invariant mode pads rows to ROW_BLOCK and runs fixed-shape GEMMs.

    BLAS picks kernels (and reduction orders) by matrix shape, so a plain GEMM gives a row slightly
    different bits at M=1 and M=5; with every GEMM at M=ROW_BLOCK, a row's bits depend on that row alone.
    `packed`: the weight in oneDNN's layout (pack_for_onednn), used instead of BLAS when given.
    """
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if not batch_invariant:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    blocks = F.pad(x, (0, 0, 0, -rows % ROW_BLOCK)).reshape(-1, ROW_BLOCK, x.shape[1])
    y = torch.bmm(blocks, weight.t().expand(blocks.shape[0], -1, -1)).reshape(-1, weight.shape[0])[:rows]
    return y if bias is None else y + bias


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """A CPU weight in oneDNN's blocked layout, or None where that does not apply (other devices, dtypes) or does
    not pay on this CPU.

    Which GEMM is faster depends on the CPU: oneDNN on a prepacked weight ran the decode and verification shapes
    (tens of rows) 2-2.5x faster than torch's BLAS GEMM (MKL) on an AVX-512 EPYC (MKL takes slower paths on AMD),
    which is how vLLM's CPU build runs its linear layers too, while on an Intel Xeon with AVX-512 and AMX MKL was
    1.4x faster at one row and 4x at 160. So both are timed once per machine (`_onednn_faster`)."""
    usable = weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
    if not usable or not _onednn_packs(weight.dtype) or not _onednn_faster(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


@functools.cache
def _onednn_faster(dtype: torch.dtype) -> bool:
    """Whether oneDNN's GEMM on a prepacked weight beats torch's own on this CPU: both timed on a decode (1 row) and
    a verification shape (64 rows), up to a few seconds on a busy machine, so the verdict is kept for the machine's
    next processes (`cpu_kernels.remembered`; torch's version is part of its key, as it brings both libraries).

    Timed on one thread: the gap this choice is for comes from the kernels (2-4x either way, see above), and with
    more threads than free cores a BLAS GEMM waits at its barriers for a thread that lost its core (6x slower
    beside two busy processes, where oneDNN was 2x), which would pick oneDNN for the process's life although the
    step then runs on the thread count measured to pay (one, at one request). The two are timed in turns and
    compared on the fastest turn and the typical one, so that a burst of other work sparing one of them does not
    decide. Either is a fast kernel of the default mode; the strict mode packs nothing."""
    name = f"onednn-faster-{str(dtype).removeprefix('torch.')}-torch{torch.__version__}"
    return remembered(name, lambda: _time_onednn_against_blas(dtype))


def _time_onednn_against_blas(dtype: torch.dtype) -> bool:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 512, generator=generator).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    inputs = [torch.randn(rows, 512, generator=generator).to(dtype) for rows in (1, 64)]

    def blas() -> None:
        for x in inputs:
            F.linear(x, weight)

    def onednn() -> None:
        for x in inputs:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        blas(), onednn()
        turns = [(_seconds(blas), _seconds(onednn)) for _ in range(25)]
    finally:
        torch.set_num_threads(threads)
    blas_s, onednn_s = [t for t, _ in turns], [t for _, t in turns]
    return min(onednn_s) < 0.9 * min(blas_s) and statistics.median(onednn_s) < 0.9 * statistics.median(blas_s)


def _seconds(run: Callable[[], object], calls: int = 10) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return time.perf_counter() - start


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN prepacks weights of `dtype`: bf16 needs AVX-512 (bw, vl, dq) or
    AVX-NE-CONVERT, and on a CPU without them (an AVX2 laptop) the layers keep torch's own GEMM."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def _check_shape(source: TensorSlice, expected: tuple[int, ...]) -> None:
    if tuple(source.shape) != tuple(expected):
        raise CheckpointError(
            f"shape mismatch for tensor {source.name} in {source.file.name}: "
            f"checkpoint has {list(source.shape)}, the model expects {list(expected)}"
        )


def _load_rows(dst: torch.Tensor, source: TensorSlice, full_rows: int, start: int, dim: int = 0) -> None:
    """Copy source[start : start + len] along `dim` into the front of dst (which may be padded)."""
    expected = list(dst.shape)
    expected[dim] = full_rows
    _check_shape(source, tuple(expected))
    length = min(dst.shape[dim], full_rows - start)
    if length > 0:  # a trailing vocab shard may be all padding
        dst.narrow(dim, 0, length).copy_(source.read(dim, start, length))


def replicated_loader(param: nn.Parameter, source: TensorSlice, shard_id: object = None) -> None:
    _check_shape(source, tuple(param.shape))
    param.data.copy_(source.read())


def _param(shape: tuple[int, ...], loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), replicated_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # see rms_normalize
        return self.weight * rms_normalize(x, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, before the weight: Hugging Face's op order, in fp32 whatever the dtype.

    In float32, torch's `F.rms_norm` computes the same ops in the same order (bit for bit, which
    tests/test_norms.py holds it to) from one call instead of eight dispatched from Python."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], None, eps)
    dtype = x.dtype
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with cos/sin tables precomputed for every position.

    Hugging Face computes x * cos + cat(-x2, x1) * sin; we compute x * cos + cat(x2, x1) * cat(-sin, sin)
    (one roll instead of chunk, neg and cat), which is the same product bit for bit.
    """

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq
        self.register_buffer("cos", torch.cat((freqs, freqs), dim=-1).cos(), persistent=False)
        self.register_buffer("signed_sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each token's position, [tokens, 1, head_dim], computed once per forward."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.signed_sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate x [tokens, heads, head_dim] by its tokens' positions."""
        cos, signed_sin = table
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies as transformers computes them (default, linear, llama3)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@contextmanager
def quantized_linears(quant: QuantConfig | None) -> Iterator[None]:
    """Linear layers built inside keep a `quant` checkpoint's weights as stored and multiply them with the
    Triton GEMMs (QuantizedWeight); None: dense weights. A context, as torch.device is for the same
    construction, so that the model's classes need not pass it down."""
    token = _QUANTIZED.set(quant)
    try:
        yield
    finally:
        _QUANTIZED.reset(token)


def current_quantization() -> QuantConfig | None:
    """The quantization whose weights layers built now keep as stored (quantized_linears), or None."""
    return _QUANTIZED.get()


class LinearBase(nn.Module):
    def __init__(self, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        self.tp, self.batch_invariant = tp, batch_invariant
        self.bias: nn.Parameter | None = None
        self.packed: torch.Tensor | None = None  # see pack_for_onednn
        self.quantized: QuantizedWeight | None = None
        self.lora: Adapters | None = None  # this layer's adapters (model/lora.py), when LoRA is enabled

    def shard(self, shard_id: object = None) -> Shard:
        """Where the checkpoint tensor `shard_id` (a packed part, or None) goes in this rank's weight."""
        raise NotImplementedError

    def weight_loader(self, param: nn.Parameter, source: TensorSlice, shard_id: object = None) -> None:
        self._place(param, source, *self.shard(shard_id))

    def _weight(self, shape: tuple[int, int]) -> nn.Parameter:
        """The weight parameter; inside quantized_linears, an empty one beside the quantized storage (it is
        filled only if the checkpoint stores this layer's weight in a way the storage cannot take)."""
        quant = current_quantization()
        if quant is None or not QuantizedWeight.can_hold(quant, *shape):
            return _param(shape, self.weight_loader)
        self.quantized = QuantizedWeight(quant, *shape, torch.get_default_dtype())
        return _param((0,), self.weight_loader)

    def _place(self, param: nn.Parameter, source: TensorSlice, dim: int, offset: int, length: int, full: int,
               start: int) -> None:
        """Load source[start : start + length] along `dim` (a tensor of `full` there) into the parameter at
        [offset, offset + length): into the quantized storage where it fits, else densely."""
        if param is self.weight and self.quantized is not None:
            if self.quantized.can_place(source, dim, offset, length, full, start):
                _check_shape(source, tuple(full if d == dim else n for d, n in enumerate(self.quantized.shape)))
                self.quantized.place(source, dim, offset, length, start)  # type: ignore[arg-type]
                return
            self._dequantize()
        _load_rows(param.data.narrow(dim, offset, length), source, full, start, dim)

    def _dequantize(self) -> None:
        """Hold the weight densely from now on (what is loaded so far included)."""
        assert self.quantized is not None
        self.weight.data = self.quantized.dequantize()
        self.quantized = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized is not None:
            y = self.quantized.matmul(x, self.batch_invariant)
            y = y if bias is None else y + bias
        else:
            y = linear(x, self.weight, bias, self.batch_invariant, self.packed)
        # Before a row-parallel layer's all-reduce: the adapters' partial sums are reduced with the base's.
        return y if self.lora is None else self.lora.add_to(y, x)

    def pack(self) -> None:
        """Keep the weight in oneDNN's layout only, where that applies (pack_for_onednn): the loaded copy is
        dropped, so the weights take their memory once. `dense_weight` gives the matrix back."""
        if self.quantized is not None:
            return
        packed = None if self.batch_invariant else pack_for_onednn(self.weight)
        if packed is not None:
            self.packed = packed
            self.weight.data = self.weight.data.new_empty(0)

    def dense_weight(self) -> torch.Tensor:
        """This rank's weight as a plain [out, in] matrix (for inspection: the forward never needs it)."""
        if self.quantized is not None:
            return self.quantized.dequantize()
        return self.packed.to_dense() if self.packed is not None else self.weight.data


def tp_split(features: int, tp: TensorParallel, kind: str) -> int:
    """Each rank's share of a layer's `kind` (input or output) features; a ValueError where they do not split."""
    if features % tp.size:
        raise ValueError(f"{kind} size {features} is not divisible by tensor-parallel size {tp.size}")
    return features // tp.size


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, batch_invariant: bool):
        super().__init__(tp, batch_invariant)
        self.out_local = tp_split(out_features, tp, "output")
        self.weight = self._weight((self.out_local, in_features))
        if bias:
            self.bias = _param((self.out_local,), self.weight_loader)

    def shard(self, shard_id: object = None) -> Shard:
        return 0, 0, self.out_local, self.out_local * self.tp.size, self.tp.rank * self.out_local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one GEMM (gate_proj + up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TensorParallel,
                 batch_invariant: bool):
        for size in output_sizes:
            tp_split(size, tp, "output")
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp, batch_invariant)

    def shard(self, shard_id: object = None) -> Shard:
        assert isinstance(shard_id, int)
        local = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        return 0, offset, local, self.output_sizes[shard_id], self.tp.rank * local


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed in one column-parallel GEMM, split by heads across ranks.

    With fewer kv heads than ranks, each kv head is replicated on tp_size / num_kv_heads ranks.
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TensorParallel, batch_invariant: bool):
        check_head_split(num_heads, num_kv_heads, tp.size)
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.kv_head_start = tp.rank * num_kv_heads // tp.size
        self.full = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        local_out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, local_out * tp.size, bias, tp, batch_invariant)

    def split_sizes(self) -> tuple[int, int, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return q, kv, kv

    def shard(self, shard_id: object = None) -> Shard:
        q, kv, _ = self.split_sizes()
        if shard_id == "q":
            offset, length, start = 0, q, self.tp.rank * q
        elif shard_id in ("k", "v"):
            offset, length, start = q if shard_id == "k" else q + kv, kv, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        return 0, offset, length, self.full[shard_id], start


def check_head_split(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    if num_heads % tp_size:
        raise ValueError(f"num_attention_heads={num_heads} is not divisible by tensor-parallel size {tp_size}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} must be a multiple or a divisor of tensor-parallel size {tp_size}"
        )


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed over the TP group."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, batch_invariant: bool):
        super().__init__(tp, batch_invariant)
        self.in_local = tp_split(in_features, tp, "input")
        self.weight = self._weight((out_features, self.in_local))
        if bias:  # replicated, added once after the reduction
            self.bias = _param((out_features,), replicated_loader)

    def shard(self, shard_id: object = None) -> Shard:
        return 1, 0, self.in_local, self.in_local * self.tp.size, self.tp.rank * self.in_local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split across ranks (the last shard zero-padded); lookups summed over the group."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        self.tp, self.batch_invariant, self.vocab_size = tp, batch_invariant, vocab_size
        self.rows = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows
        self.weight = _param((self.rows, hidden), self.weight_loader)
        # The LM head's packed weight (pack_for_onednn), beside the dense one: an LM head tied to the
        # embedding shares that one, which the lookups read.
        self.packed: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, source: TensorSlice, shard_id: object = None) -> None:
        param.data.zero_()
        _load_rows(param.data, source, self.vocab_size, self.vocab_start)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)  # exactly one rank contributes a non-zero row


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary rows, gathered so every rank holds the full row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear(x, self.weight, None, self.batch_invariant, self.packed)
        return self.tp.all_gather_last_dim(logits)[:, : self.vocab_size]
