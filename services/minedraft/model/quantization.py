"""Quantized checkpoints, dequantized as they are read: block-scaled FP8 and 4-bit AWQ.

A checkpoint says how it is quantized in config.json's `quantization_config`. The methods read here:

- `fp8` with `weight_block_size` [b0, b1] (DeepSeek-V3 / Qwen3-FP8 layout): `X.weight` in float8_e4m3fn
  and `X.weight_scale_inv` in float32, one scale per b0 x b1 block; the weight is fp8 x its block's scale.
- `awq`, 4 bits, GEMM layout: `X.qweight` int32 [in, out / 8] and `X.qzeros` int32 [in / group, out / 8],
  eight 4-bit values per int32 in AWQ's interleaved order, and `X.scales` [in / group, out]; the weight
  is (q - zero) x scale, transposed to [out, in].

Every quantized tensor is dequantized once, at load, into the model's dtype: the model then runs its
ordinary kernels at full weight memory (no FP8 or int4 GEMM yet). Layers a checkpoint leaves unquantized
(embeddings, norms, the LM head, MoE routers) are read as they are. Any other method is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minedraft.model.checkpoint import CheckpointError

if TYPE_CHECKING:
    import torch

    from minedraft.model.checkpoint import CheckpointReader

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
    """A quantized weight as a TensorSlice reads: its logical [out, in] shape, dequantized on read."""

    def __init__(self, name: str, file: Path, shape: tuple[int, ...], dequantize: Any) -> None:
        self.name, self.file, self.shape = name, file, shape
        self._dequantize = dequantize

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        full = self._dequantize()  # scales and packing do not align with tensor-parallel slices: all of it
        if dim is None:
            return full
        return full.narrow(dim, start, self.shape[dim] - start if length is None else length)


def quantized_tensor(reader: CheckpointReader, name: str, quant: QuantConfig) -> DequantizedTensor | None:
    """The dequantizing view of `name` if the checkpoint stores it quantized, else None."""
    if not name.endswith(".weight"):
        return None
    base = name[: -len(".weight")]
    if quant.method == "fp8" and f"{name}_scale_inv" in reader:
        weight, scale = reader.raw_tensor(name), reader.raw_tensor(f"{name}_scale_inv")
        return DequantizedTensor(name, weight.file, weight.shape,
                                 lambda: dequantize_fp8(weight.read(), scale.read(), quant.block))  # fmt: skip
    if quant.method == "awq" and name not in reader and f"{base}.qweight" in reader:
        qweight, qzeros, scales = (reader.raw_tensor(f"{base}.{part}") for part in ("qweight", "qzeros", "scales"))
        shape = (qweight.shape[1] * 8, qweight.shape[0])
        return DequantizedTensor(name, qweight.file, shape, lambda: dequantize_awq(
            qweight.read(), qzeros.read(), scales.read(), quant.group_size, name))  # fmt: skip
    return None


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

    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
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
