"""Quantized checkpoints, dequantized as they are read: block-scaled FP8 and 4-bit AWQ.

A checkpoint says how it is quantized in config.json's `quantization_config`. The methods read here:

- `fp8` with `weight_block_size` [b0, b1] (DeepSeek-V3 / Qwen3-FP8 layout): `X.weight` in float8_e4m3fn
  and `X.weight_scale_inv` in float32, one scale per b0 x b1 block; the weight is fp8 x its block's scale.
- `awq`, 4 bits, GEMM layout: `X.qweight` int32 [in, out / 8] and `X.qzeros` int32 [in / group, out / 8],
  eight 4-bit values per int32 in AWQ's interleaved order, and `X.scales` [in / group, out]; the weight
  is (q - zero) x scale, transposed to [out, in].

On CPU every quantized tensor is dequantized once, at load, into the model's dtype: the model then runs
its ordinary kernels at full weight memory. On CUDA (with triton) the linear layers keep their weights as
the checkpoint stores them (`QuantizedWeight`: one byte per FP8 weight, half a byte per AWQ weight) and
multiply with Triton GEMMs that dequantize tile by tile (model/kernels/triton_quant.py); so do the MoE experts,
stacked per layer (a `QuantizedWeight` with a leading expert dimension, this rank's slice of each expert)
and multiplied by grouped GEMMs, one launch for every expert's gate/up and one for down
(model/kernels/triton_moe.py). A layer or expert stack whose scale blocks or packing do not line up with its
tensor-parallel shard or packed q/k/v or gate/up part is dequantized at load as on CPU (for experts, the
runner logs which). Layers a checkpoint leaves unquantized (embeddings, norms, the LM head, MoE routers)
are read as they are. Any other method is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minedraft.model.errors import CheckpointError

if TYPE_CHECKING:
    import torch

    from minedraft.model.tensor_slice import TensorSlice

SUPPORTED_QUANT_METHODS = ("fp8 (weight_block_size)", "awq (4-bit, gemm)")
# AWQ packs output columns 0..7 of a group of eight into an int32's nibbles in this order.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class QuantConfig:
    method: str  # fp8 | awq
    block: tuple[int, int] = (128, 128)  # fp8: rows x columns per scale
    group_size: int = 128  # awq: input features per scale and zero

    def describe(self) -> str:
        """How the checkpoint stores its weights, as GetServerInfo reports it."""
        if self.method == "fp8":
            return f"fp8 (blocks {self.block[0]}x{self.block[1]})"
        return f"awq (4-bit, group {self.group_size})"


def parse_quant_config(raw: dict[str, Any], source: str | Path) -> QuantConfig | None:
    """config.json's quantization_config as one we can load exactly, or a CheckpointError naming what is not."""
    quant = raw.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", "")).lower()
    supported = f"supported: {', '.join(SUPPORTED_QUANT_METHODS)}, or unquantized weights"
    if method == "fp8":
        block = quant.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(f"{source}: fp8 quantization without weight_block_size (per-tensor or per-channel "
                                  f"scales) is not supported; {supported}")  # fmt: skip
        if str(quant.get("fmt", "e4m3")).lower() != "e4m3":
            raise CheckpointError(f"{source}: fp8 format {quant.get('fmt')!r} is not supported (only e4m3)")
        return QuantConfig("fp8", block=(block[0], block[1]))
    if method == "awq":
        bits, version = quant.get("bits", quant.get("w_bit")), str(quant.get("version", "gemm")).lower()
        group = quant.get("group_size", quant.get("q_group_size"))
        if bits != 4 or version != "gemm" or not quant.get("zero_point", True):
            raise CheckpointError(f"{source}: awq with bits={bits}, version={version!r}, zero_point="
                                  f"{quant.get('zero_point', True)} is not supported (only 4-bit gemm with zero "
                                  "points)")  # fmt: skip
        if not isinstance(group, int) or group <= 0:
            raise CheckpointError(f"{source}: awq group_size must be a positive integer, got {group!r}")
        return QuantConfig("awq", group_size=group)
    raise CheckpointError(f"{source}: quantization method {method or 'unnamed'!r} is not supported; {supported}")


class DequantizedTensor:
    """A quantized weight as a TensorSlice reads: its logical [out, in] shape, dequantized on read; `parts`
    are the stored tensors (fp8: weight, scale; awq: qweight, qzeros, scales) for QuantizedWeight."""

    def __init__(self, name: str, file: Path, shape: tuple[int, ...], dequantize: Any, quant: QuantConfig,
                 parts: dict[str, TensorSlice]) -> None:
        self.name, self.file, self.shape = name, file, shape
        self._dequantize = dequantize
        self.quant, self.parts = quant, parts

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        full = self._dequantize()  # scales and packing do not align with tensor-parallel slices: all of it
        if dim is None:
            return full
        return full.narrow(dim, start, self.shape[dim] - start if length is None else length)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 [out, in] x per-block scales [ceil(out / b0), ceil(in / b1)] -> float32 [out, in]."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    if scale.shape != weight.shape:
        raise CheckpointError(f"fp8 scales of shape {list(scale_inv.shape)} do not cover a weight of shape "
                              f"{list(weight.shape)} in blocks of {list(block)}")  # fmt: skip
    return weight.float() * scale


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [n, m] holding eight 4-bit values each (AWQ's order) -> int32 [n, 8 m] in column order."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [n, m, 8]: nibble i holds column AWQ_PACK_ORDER[i]
    columns = torch.empty_like(nibbles)
    columns[:, :, list(AWQ_PACK_ORDER)] = nibbles
    return columns.reshape(packed.shape[0], -1)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int,
                   name: str) -> torch.Tensor:
    """AWQ's packed [in, out / 8] weights, zeros and [in / group, out] scales -> float32 [out, in]."""
    values, zeros = unpack_awq(qweight), unpack_awq(qzeros)
    in_features = values.shape[0]
    if in_features % group or zeros.shape != (in_features // group, values.shape[1]) or scales.shape != zeros.shape:
        raise CheckpointError(f"{name}: awq qweight {list(qweight.shape)}, qzeros {list(qzeros.shape)} and scales "
                              f"{list(scales.shape)} do not fit group_size {group}")  # fmt: skip
    per_row = lambda t: t.repeat_interleave(group, 0)  # noqa: E731
    return ((values - per_row(zeros)).float() * per_row(scales.float())).t().contiguous()


class QuantizedWeight:
    """A linear layer's [out, in] weight kept as its checkpoint stores it, for the Triton GEMMs; with
    `experts`, one such weight per expert, stacked (every part gets a leading expert dimension).

    Filled part by part as the layer's loader places checkpoint tensors (a tensor-parallel shard, a q/k/v
    or gate/up part at an offset): `can_place` says whether a part's scale blocks (fp8) or packing and
    groups (awq) line up with where it goes; where they do not, the layer dequantizes instead."""

    def __init__(self, quant: QuantConfig, out_features: int, in_features: int, dtype: torch.dtype,
                 experts: int | None = None) -> None:
        import torch

        self.quant, self.shape, self.dtype, self.experts = quant, (out_features, in_features), dtype, experts
        lead = () if experts is None else (experts,)
        if quant.method == "fp8":
            b0, b1 = quant.block
            self.parts = {"weight": torch.zeros(*lead, out_features, in_features, dtype=torch.float8_e4m3fn),
                          "scale": torch.zeros(*lead, -(-out_features // b0), -(-in_features // b1))}  # fmt: skip
        else:
            group = quant.group_size
            self.parts = {"qweight": torch.zeros(*lead, in_features, out_features // 8, dtype=torch.int32),
                          "qzeros": torch.zeros(*lead, in_features // group, out_features // 8, dtype=torch.int32),
                          "scales": torch.zeros(*lead, in_features // group, out_features, dtype=dtype)}  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Device bytes of the stored parts."""
        return sum(part.numel() * part.element_size() for part in self.parts.values())

    @staticmethod
    def can_hold(quant: QuantConfig, out_features: int, in_features: int) -> bool:
        """Whether a layer of this shape can be stored quantized at all (awq packs 8 outputs per int32 and
        groups inputs)."""
        return quant.method == "fp8" or (out_features % 8 == 0 and in_features % quant.group_size == 0)

    def can_place(self, source: object, dim: int, offset: int, length: int, full: int, start: int) -> bool:
        """Whether source[start : start + length] along `dim` (of `full`) can go to [offset, offset + length)."""
        if not isinstance(source, DequantizedTensor) or source.quant != self.quant:
            return False
        if self.quant.method == "fp8":
            unit = self.quant.block[dim]
            whole = length % unit == 0 or (start + length == full and offset + length == self.shape[dim])
            return offset % unit == 0 and start % unit == 0 and whole
        unit = 8 if dim == 0 else self.quant.group_size
        return offset % unit == 0 and start % unit == 0 and length % unit == 0

    def place(self, source: DequantizedTensor, dim: int, offset: int, length: int, start: int,
              expert: int | None = None) -> None:
        """Copy the stored tensors of source[start : start + length] along `dim` (after can_place), into
        expert `expert`'s weight where they are stacked."""
        copy = lambda part, d, at, n, first: self._copy(part, expert, source, d, at, n, first)  # noqa: E731
        if self.quant.method == "fp8":
            unit = self.quant.block[dim]
            copy("weight", dim, offset, length, start)
            copy("scale", dim, offset // unit, -(-length // unit), start // unit)
        elif dim == 0:  # output features: columns of the packed tensors, eight per int32
            copy("qweight", 1, offset // 8, length // 8, start // 8)
            copy("qzeros", 1, offset // 8, length // 8, start // 8)
            copy("scales", 1, offset, length, start)
        else:  # input features: rows, one zero and one scale row per group
            group = self.quant.group_size
            copy("qweight", 0, offset, length, start)
            copy("qzeros", 0, offset // group, length // group, start // group)
            copy("scales", 0, offset // group, length // group, start // group)

    def _copy(self, part: str, expert: int | None, source: DequantizedTensor, dim: int, offset: int, length: int,
              start: int) -> None:
        dst = self.parts[part] if expert is None else self.parts[part][expert]
        dst.narrow(dim, offset, length).copy_(source.parts[part].read(dim, start, length))

    def matmul(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """x @ W.T for one (unstacked) weight; stacked experts go through model/kernels/triton_moe.py."""
        from minedraft.model.kernels.triton_quant import awq_matmul, fp8_block_matmul

        if self.quant.method == "fp8":
            return fp8_block_matmul(x, self.parts["weight"], self.parts["scale"], self.quant.block,
                                    batch_invariant=batch_invariant)  # fmt: skip
        return awq_matmul(x, self.parts["qweight"], self.parts["qzeros"], self.parts["scales"], self.quant.group_size,
                          batch_invariant=batch_invariant)  # fmt: skip

    def dequantize(self) -> torch.Tensor:
        """The dense [out, in] weight in the layer's dtype (what the CPU path would have loaded); stacked
        experts: [experts, out, in], one expert at a time (the float32 temporaries are one expert's)."""
        if self.experts is None:
            return self._dequantize_one(self.parts)
        first = next(iter(self.parts.values()))
        dense = first.new_empty((self.experts, *self.shape), dtype=self.dtype)
        for e in range(self.experts):
            dense[e] = self._dequantize_one({name: part[e] for name, part in self.parts.items()})
        return dense

    def _dequantize_one(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.quant.method == "fp8":
            weight = dequantize_fp8(parts["weight"], parts["scale"], self.quant.block)
        else:
            weight = dequantize_awq(parts["qweight"], parts["qzeros"], parts["scales"], self.quant.group_size,
                                    "a quantized layer")  # fmt: skip
        return weight.to(self.dtype)
