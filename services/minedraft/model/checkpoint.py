"""Checkpoints: finding and validating files, lazy safetensors reads (single or sharded); a GGUF file is read
by model/gguf.py behind the same reader interface (`open_reader`).

Tensors are read through ``safe_open(...).get_slice`` so a tensor-parallel rank reads only its shard.
A folder without safetensors may hold ``pytorch_model.bin`` (single or sharded by its index), as published
EAGLE heads do: it is read with ``torch.load(weights_only=True)``, torch's restricted unpickler, which builds
tensors and plain containers only and refuses anything that would run code. Other pickles (.pt, .pth) are
refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from minedraft.model.errors import CheckpointError, CheckpointNotFoundError
from minedraft.model.gguf import GGUFReader, gguf_in_folder, is_gguf, open_gguf
from minedraft.model.hub import local_folder
from minedraft.model.packaged import resolve_packaged
from minedraft.model.quantization import DequantizedTensor, QuantConfig, dequantize_awq, dequantize_fp8
from minedraft.model.tensor_slice import TensorSlice

if TYPE_CHECKING:  # torch stays unimported for tokenizer/config-only users
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILE = "pytorch_model.bin"
PICKLE_INDEX_FILE = "pytorch_model.bin.index.json"


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint `path` names: a folder with config.json, or a GGUF file (model/gguf.py). `path` may be a
    packaged model's name (model/packaged.py), a hub id (model/hub.py), a .gguf file, or a folder that holds
    one GGUF file and no config.json."""
    packaged = resolve_packaged(path)
    if packaged is not None:
        return packaged
    folder = local_folder(path)
    if not folder.exists():
        raise CheckpointNotFoundError(f"checkpoint folder not found: {folder}")
    if is_gguf(folder) and folder.is_file():
        return folder
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint path is neither a folder nor a .gguf file: {folder}")
    if not (folder / "config.json").is_file() and (folder / "adapter_config.json").is_file():
        raise CheckpointError(f"{folder} is a LoRA adapter, not a model: serve its base model with "
                              f"--enable-lora --lora-modules NAME={folder}")
    if not (folder / "config.json").is_file():
        gguf = gguf_in_folder(folder)
        if gguf is not None:
            return gguf
        raise CheckpointNotFoundError(f"config.json not found in checkpoint folder {folder} (nor a .gguf file)")
    return folder


def open_reader(path: Path, quant: QuantConfig | None = None) -> CheckpointReader | GGUFReader:
    """The tensors of the checkpoint at `path` (resolved by resolve_checkpoint), by Hugging Face name."""
    if is_gguf(path):
        return GGUFReader(open_gguf(path))
    return CheckpointReader(path, quant)


def read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise CheckpointNotFoundError(f"{path.name} not found in {path.parent}")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


class CheckpointReader:
    """Maps tensor names to safetensors files and opens each file once, on first use. With a quantization
    config, `tensor` reads quantized weights dequantized (model/quantization.py)."""

    def __init__(self, folder: str | Path, quant: QuantConfig | None = None) -> None:
        self.folder = Path(folder)
        self.weight_map = find_weight_files(self.folder)
        self.quant = quant
        self._handles: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def tensor(self, name: str) -> TensorSlice | DequantizedTensor:
        """The model's view of tensor `name`: dequantized where the checkpoint stores it quantized."""
        if self.quant is not None:
            view = self._quantized(name, self.quant)
            if view is not None:
                return view
        tensor = self.raw_tensor(name)
        if tensor.dtype.startswith(("F8", "I8", "U8", "I32")):  # never copy quantized codes as if they were weights
            raise CheckpointError(f"tensor {name} in {tensor.file.name} is stored as {tensor.dtype} without scales "
                                  "that config.json's quantization_config tells how to read")  # fmt: skip
        return tensor

    def _quantized(self, name: str, quant: QuantConfig) -> DequantizedTensor | None:
        """The dequantizing view of `name` if the checkpoint stores it quantized, else None."""
        if not name.endswith(".weight"):
            return None
        base = name[: -len(".weight")]
        if quant.method == "fp8" and f"{name}_scale_inv" in self:
            weight, scale = self.raw_tensor(name), self.raw_tensor(f"{name}_scale_inv")
            return DequantizedTensor(name, weight.file, weight.shape,
                                     lambda: dequantize_fp8(weight.read(), scale.read(), quant.block), quant,
                                     {"weight": weight, "scale": scale})  # fmt: skip
        if quant.method == "awq" and name not in self and f"{base}.qweight" in self:
            qweight, qzeros, scales = (self.raw_tensor(f"{base}.{part}") for part in ("qweight", "qzeros", "scales"))
            shape = (qweight.shape[1] * 8, qweight.shape[0])
            return DequantizedTensor(name, qweight.file, shape, lambda: dequantize_awq(
                qweight.read(), qzeros.read(), scales.read(), quant.group_size, name), quant,
                {"qweight": qweight, "qzeros": qzeros, "scales": scales})  # fmt: skip
        return None

    def raw_tensor(self, name: str) -> TensorSlice:
        """Tensor `name` exactly as stored."""
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint in {self.folder}")
        return TensorSlice(name, file, self._open(file))

    def _open(self, file: Path) -> Any:
        if file not in self._handles:
            self._handles[file] = _PickledTensors(file) if file.suffix == ".bin" else open_safetensors(file)
        return self._handles[file]

    def close(self) -> None:
        self._handles.clear()


def open_safetensors(file: Path) -> Any:
    if not file.is_file():
        raise CheckpointNotFoundError(f"safetensors file not found: {file}")
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"corrupt or unreadable safetensors file {file}: {exc}") from exc


def find_weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors, the shard index, or every *.safetensors present; else
    from pytorch_model.bin or its shard index."""
    if (folder / SINGLE_FILE).is_file():
        return _names_in(folder / SINGLE_FILE)
    if (folder / INDEX_FILE).is_file():
        return _weight_map_from_index(folder, INDEX_FILE)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return {name: f for f in files for name in _names_in(f)}
    if (folder / PICKLE_FILE).is_file():
        return _names_in(folder / PICKLE_FILE)
    if (folder / PICKLE_INDEX_FILE).is_file():
        return _weight_map_from_index(folder, PICKLE_INDEX_FILE)
    pickles = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
    hint = f" (found {', '.join(sorted(pickles))}; of pickled weights only {PICKLE_FILE} is read)"
    raise CheckpointNotFoundError(
        f"no weights in {folder}: expected {SINGLE_FILE}, {INDEX_FILE}, {PICKLE_FILE} or {PICKLE_INDEX_FILE}"
        + (hint if pickles else "")
    )


def _names_in(file: Path) -> dict[str, Path]:
    if file.suffix == ".bin":
        return dict.fromkeys(_PickledTensors(file).tensors, file)
    with open_safetensors(file) as handle:
        return dict.fromkeys(handle.keys(), file)


def _weight_map_from_index(folder: Path, index_file: str) -> dict[str, Path]:
    index = read_json(folder / index_file, required=True) or {}
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{folder / index_file} has no weight_map")
    files = {name: folder / str(fname) for name, fname in weight_map.items()}
    for file in sorted(set(files.values())):
        listed = {n for n, f in files.items() if f == file}
        missing = listed - set(_names_in(file))  # also validates that every shard opens
        if missing:
            raise CheckpointError(f"{file} lacks tensors its index lists, e.g. {sorted(missing)[0]}")
    return files


class _PickledTensors:
    """A pytorch_model.bin opened like a safetensors file (`get_slice`), loaded with torch's restricted
    unpickler (weights_only=True) and memory-mapped where the file's format allows."""

    def __init__(self, file: Path) -> None:
        import pickle

        import torch

        if not file.is_file():
            raise CheckpointNotFoundError(f"weights file not found: {file}")
        try:
            try:
                loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped
                loaded = torch.load(file, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as exc:
            raise CheckpointError(f"corrupt, unreadable or unsafe pickled weights {file}: {exc}") from exc
        if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
            raise CheckpointError(f"{file} does not hold a state dict (tensor names -> tensors)")
        self.tensors: dict[str, torch.Tensor] = loaded

    def get_slice(self, name: str) -> _PickledSlice:
        return _PickledSlice(self.tensors[name])


class _PickledSlice:
    """One tensor of a pickled state dict, answering as a safetensors slice does."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        import torch

        names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                 torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8",
                 torch.bool: "BOOL"}  # fmt: skip
        return names.get(self.tensor.dtype, str(self.tensor.dtype))

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index].clone()
