"""One checkpoint tensor, read lazily (TensorSlice): what a parameter's weight loader reads (a CheckpointReader
hands them out, model/checkpoint.py; a GGUF file's GGUFTensor answers alike), and what a quantized weight's stored
parts are (model/quantization.py), below both so that neither imports the other's module for it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError

from minedraft.model.errors import CheckpointError

if TYPE_CHECKING:  # torch stays unimported for tokenizer/config-only users
    import torch


class TensorSlice:
    """One checkpoint tensor, read lazily: whole, or a contiguous range along one dimension."""

    def __init__(self, name: str, file: Path, handle: Any) -> None:
        self.name, self.file = name, file
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.dtype: str = self._slice.get_dtype()  # safetensors' name: F32, BF16, F8_E4M3, I32, ...

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        if dim is None:
            index: Any = slice(None)
        else:
            stop = self.shape[dim] if length is None else start + length
            index = (slice(None),) * dim + (slice(start, stop),)
        try:
            return self._slice[index]
        except (SafetensorError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"cannot read tensor {self.name} from {self.file}: {exc}") from exc
