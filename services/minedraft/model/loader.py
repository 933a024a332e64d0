"""Loading a model: what a checkpoint folder holds, and its weights built into a model on a device.

`Checkpoint` reads a folder's config and tells a decoder from an EAGLE head (and finds the head's target);
`load_model` builds the model in its dtype on its device, fills it from the safetensors (or with random
weights: load_format dummy), keeps a quantized checkpoint's weights as stored or dequantizes them, and sets
up LoRA pools before the weights are packed. The runner (runner.py) owns what comes after: the KV cache,
the kernels, the forwards.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from minedraft.model.checkpoint import open_reader, resolve_checkpoint
from minedraft.model.config import ModelConfig, load_model_config
from minedraft.model.eagle import EAGLE, EagleHead, eagle_head_kind
from minedraft.model.kernels import triton_module
from minedraft.model.layers import quantized_linears
from minedraft.model.lora import LoraManager, LoraOptions
from minedraft.model.parallel import TensorParallel
from minedraft.model.transformer import CausalLM

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_HALF = (torch.bfloat16, torch.float16)
LOAD_FORMATS = ("auto", "dummy")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder: its config and, for an EAGLE head (model/eagle.py), its kind and its target."""

    path: Path
    config: ModelConfig
    target_path: Path | None = None  # an EAGLE head's target: its tokenizer, embedding (EAGLE-1: and LM head)
    head_kind: str | None = None  # None: a decoder, not a head
    load_format: str = "auto"  # auto: the safetensors; dummy: random weights from config.json alone

    @classmethod
    def open(cls, path: str | Path, target_path: str | Path | None = None, load_format: str = "auto") -> Checkpoint:
        """`path` (a folder or a hub name: model/checkpoint.py) read; with `target_path` it must be an EAGLE head."""
        folder = resolve_checkpoint(path)
        config = load_model_config(folder)
        if config.is_eagle3 and target_path is None:
            raise ValueError(f"{folder} is an EAGLE-3 head: use it with method eagle3 (it runs beside its target)")
        target = resolve_checkpoint(target_path) if target_path is not None else None
        return cls(folder, config, target, _head_kind(folder, config, target, load_format), load_format)


def _head_kind(path: Path, config: ModelConfig, target_path: Path | None, load_format: str) -> str | None:
    """With target_path: the head's kind (model/eagle.py), which its folder must show. Without: None, and
    never a head (an EAGLE-1 head's config.json is a plain LlamaConfig: its weights tell)."""
    if target_path is None:
        if load_format == "auto" and eagle_head_kind(path, config) == EAGLE:
            raise ValueError(f"{path} is an EAGLE-1 head: use it with method eagle (it runs beside its target)")
        return None
    if load_format == "dummy" and not config.is_eagle3:
        return EAGLE  # no weights to tell: a LlamaConfig beside a target is an EAGLE-1 head
    kind = eagle_head_kind(path, config)
    if kind is None:
        raise ValueError(f"{path} is not an EAGLE head: its checkpoint has no fc.weight (or has a model.* "
                         "decoder, as a draft model does)")  # fmt: skip
    return kind


@dataclass(frozen=True)
class Placement:
    """Where and how the model is built: device, dtype, this rank's tensor-parallel shard, the longest
    sequence its rotary tables cover, and whether its kernels are the strict batch-invariant ones.
    `weights_bf16`: a float32 model's weights rounded to bfloat16 values at load (`weights_in_bf16`)."""

    device: torch.device
    dtype: torch.dtype
    tp: TensorParallel
    max_seq_len: int
    batch_invariant: bool
    weights_bf16: bool = False


def use_quantized_kernels(config: ModelConfig, kernel: str, device: torch.device) -> bool:
    """Whether a quantized checkpoint keeps its weights as stored for the Triton GEMMs (model/kernels/triton_quant.py,
    model/kernels/triton_moe.py) rather than dequantizing them at load: `kernel` triton, or auto on CUDA where triton
    is installed and the checkpoint's block or group shape suits the kernels' tiles."""
    quant = config.quantization
    if quant is None or kernel == "dequantize" or (kernel == "auto" and device.type != "cuda"):
        return False
    kernels = triton_module("triton_quant", "quantized_kernel", kernel)
    if kernels is None:
        return False
    return kernel == "triton" or (kernels.supports_fp8(quant.block) if quant.method == "fp8" else
                                  kernels.supports_awq(quant.group_size))


def load_model(checkpoint: Checkpoint, placement: Placement, quantized_kernels: bool,
               lora: LoraOptions | None) -> tuple[CausalLM | EagleHead, LoraManager | None]:  # fmt: skip
    """The model with its weights, and its LoRA adapters' manager where `lora` names adapters. A quantized
    checkpoint's linears keep their weights as stored with `quantized_kernels`, else hold them dequantized."""
    if checkpoint.head_kind is not None:
        if lora is not None:
            raise ValueError(f"{checkpoint.path} is an EAGLE head: LoRA adapters are for a target or a draft model")
        return _load_head(checkpoint, placement), None
    config = checkpoint.config
    with _building(placement), quantized_linears(config.quantization if quantized_kernels else None):
        model = CausalLM(config, placement.max_seq_len, placement.tp, placement.batch_invariant)
    if checkpoint.load_format == "dummy":
        _random_weights(model)
    else:
        with closing(open_reader(checkpoint.path, config.quantization)) as reader:
            model.load_weights(reader)
    if placement.weights_bf16:
        _round_to_bf16(model)
    manager = LoraManager(model, lora) if lora is not None else None  # before packing: pools take dense shapes
    model.pack_weights()
    _log_weights(model)
    return model.eval(), manager


def _load_head(checkpoint: Checkpoint, placement: Placement) -> EagleHead:
    if checkpoint.load_format == "dummy":
        return _random_weights(_new_head(checkpoint, placement, fc_bias=False)).eval()
    path, target_path = checkpoint.path, checkpoint.target_path
    assert target_path is not None  # a head has a target (Checkpoint.open)
    with closing(open_reader(path)) as reader, closing(open_reader(target_path)) as target:
        head = _new_head(checkpoint, placement, fc_bias="fc.bias" in reader)
        head.load_weights(reader, target)
    return head.eval()


def _new_head(checkpoint: Checkpoint, placement: Placement, fc_bias: bool) -> EagleHead:
    with _building(placement):
        return EagleHead(checkpoint.config, placement.max_seq_len, placement.tp, placement.batch_invariant,
                         checkpoint.head_kind, fc_bias)  # fmt: skip


def _log_weights(model: nn.Module) -> None:
    held, quantized = weight_bytes(model)
    log.info("weights on this rank: %.2f GiB, %.2f GiB of them kept quantized", held / 2**30, quantized / 2**30)
    for reason, layers in Counter(r for m in model.modules() for r in getattr(m, "fallbacks", ())).items():
        log.warning("%s (MoE layers: %d)", reason, layers)


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


def _round_to_bf16(model: nn.Module) -> None:
    """Every float32 parameter rounded to its nearest bfloat16 value, kept in float32."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype == torch.float32:
                param.copy_(param.to(torch.bfloat16))


def weights_in_bf16(dtype: torch.dtype | str, device: torch.device, config: ModelConfig) -> bool:
    """Whether 'auto' on CPU holds a bfloat16 checkpoint's weights as bfloat16 values in a float32 model: the
    arithmetic stays float32, and the one-call decode stack (model/kernels/cpu_stack.py) streams half the bytes a
    step. A bfloat16 safetensors checkpoint loses nothing; a GGUF file (declared bfloat16, as on a GPU) has its
    dequantized weights rounded, as a GPU's bfloat16 would. An explicit float32 keeps every value as stored."""
    return dtype == "auto" and device.type == "cpu" and _DTYPES.get(str(config.torch_dtype)) == torch.bfloat16


def resolve_dtype(dtype: torch.dtype | str, device: torch.device, config: ModelConfig) -> torch.dtype:
    """'auto' = float32 on CPU (see `weights_in_bf16`), the checkpoint's half type elsewhere."""
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
def _building(placement: Placement) -> Iterator[None]:
    """Parameters are created directly on the device in the target dtype (no fp32 copy on the way to a GPU)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(placement.dtype)
    try:
        with torch.device(placement.device):
            yield
    finally:
        torch.set_default_dtype(previous)
