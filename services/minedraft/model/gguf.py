"""GGUF checkpoints: llama.cpp's one-file format, read into the same model classes as a Hugging Face folder.

The file's metadata gives what a folder's config.json, generation_config.json and tokenizer files give: the
architecture and its hyperparameters (`hf_config`), the EOS ids, the BPE tokenizer (`build_tokenizer`) and
the chat template. Tensors are dequantized at load by the `gguf` library, the one llama.cpp publishes (Q8_0 and
Q4_1, the types of the packaged model, by the same arithmetic as whole-tensor torch ops: `_dequantized_in_torch`), and
read under their Hugging Face names (`GGUFReader.tensor`), so the model's weight loaders shard them as
they shard safetensors: a tensor-parallel rank dequantizes only the rows (or the blocks of columns) of its
shard. llama.cpp's converter interleaves the rotary halves of each Llama head's Q and K rows; reading undoes
that, as transformers does. What cannot be honoured (an architecture, a tensor type, a tokenizer, a
truncated file) is refused, naming it.
"""

from __future__ import annotations

from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minedraft.model.errors import CheckpointError, CheckpointNotFoundError

if TYPE_CHECKING:
    import numpy as np
    import torch
    from tokenizers import Tokenizer

GGUF_SUFFIX = ".gguf"
_MAGIC = b"GGUF"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# How text is split before BPE, by the file's `tokenizer.ggml.pre` (the pre-tokenizers llama.cpp names).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
PRE_TOKENIZER_SPLITS = {
    "default": [_GPT2_SPLIT], "gpt2": [_GPT2_SPLIT], "smollm": [r"\p{N}", _GPT2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT], "llama3": [_LLAMA3_SPLIT], "qwen2": [_QWEN2_SPLIT],
}  # fmt: skip
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types that are added tokens


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == GGUF_SUFFIX


def gguf_in_folder(folder: Path) -> Path | None:
    """The one .gguf file of a folder that holds no config.json; None if it holds none. Several: an error."""
    files = sorted(p for p in folder.iterdir() if is_gguf(p) and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise CheckpointError(f"{folder} holds several GGUF files ({names}): pass the one to serve")
    return files[0] if files else None


@lru_cache(maxsize=8)
def _opened(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """The file opened once per process (config, tokenizer and weights all read it), reopened if it changed."""
    path = Path(path).resolve()
    if not path.is_file():
        raise CheckpointNotFoundError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _opened(path, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=1)
def _fast_reader() -> type:
    """The gguf library's reader, slicing a plain view of its memory map: the library slices the np.memmap
    itself, whose per-slice bookkeeping makes reading a 49k-token vocabulary take seconds instead of a tenth."""
    try:
        import numpy as np
        from gguf import GGUFReader as LibraryReader
    except ImportError as exc:
        raise CheckpointError("reading a GGUF file needs the gguf package: pip install 'minedraft[gguf]'") from exc

    class FastReader(LibraryReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> Any:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            dtype = np.dtype(dtype)
            values = plain[offset:offset + dtype.itemsize * int(count)].view(dtype)[: int(count)]
            return values.view(values.dtype.newbyteorder(override_order or self.byte_order))

    return FastReader


class GGUFFile:
    """One GGUF file opened once (memory-mapped): its metadata in Hugging Face terms, and its tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointNotFoundError(f"GGUF file not found: {self.path}")
        with self.path.open("rb") as handle:
            if handle.read(4) != _MAGIC:
                raise CheckpointError(f"{self.path} is not a GGUF file (it does not start with 'GGUF')")
        try:
            self.reader = _fast_reader()(self.path, "r")
        except Exception as exc:  # noqa: BLE001 (the library raises ValueError, struct.error, IndexError, ...)
            raise CheckpointError(f"corrupt or truncated GGUF file {self.path}: {type(exc).__name__}: {exc}") from exc
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._check_complete()

    def _check_complete(self) -> None:
        """A file cut short still parses its header: every tensor's data must lie inside the file."""
        size = self.path.stat().st_size
        for tensor in self.reader.tensors:
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > size or tensor.data.nbytes != tensor.n_bytes:
                raise CheckpointError(f"truncated GGUF file {self.path}: tensor {tensor.name} ends at byte {end}, "
                                      f"the file has {size}")  # fmt: skip

    def field(self, key: str, default: Any = None) -> Any:
        found = self.reader.fields.get(key)
        return default if found is None else found.contents()

    @cached_property
    def tokens(self) -> list[str]:
        """The vocabulary, by id."""
        return self.field("tokenizer.ggml.tokens") or []

    @cached_property
    def architecture(self) -> str:
        arch = self.field("general.architecture")
        if arch not in ARCHITECTURES:
            raise CheckpointError(f"{self.path}: GGUF architecture {arch!r} is not supported; supported: "
                                  f"{', '.join(ARCHITECTURES)}")  # fmt: skip
        return arch

    def _arch_field(self, name: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{name}", default)

    def _required(self, name: str) -> Any:
        value = self._arch_field(name)
        if value is None:
            raise CheckpointError(f"{self.path}: GGUF metadata lacks {self.architecture}.{name}")
        return value

    def hf_config(self) -> dict[str, Any]:
        """The config.json this file's metadata amounts to (model/config.py parses it)."""
        heads = int(self._required("attention.head_count"))
        hidden = int(self._required("embedding_length"))
        if "rope_freqs.weight" in self.tensors:
            raise CheckpointError(f"{self.path}: per-frequency RoPE factors (rope_freqs, Llama 3.1's scaling) are "
                                  "not supported from GGUF; serve the model's Hugging Face folder")  # fmt: skip
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": int(self._arch_field("vocab_size") or len(self.tokens)),
            "hidden_size": hidden,
            "intermediate_size": int(self._required("feed_forward_length")),
            "num_hidden_layers": int(self._required("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch_field("attention.head_count_kv") or heads),
            "head_dim": int(self._arch_field("attention.key_length") or hidden // heads),
            "max_position_embeddings": int(self._arch_field("context_length") or 2048),
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon") or 1e-6),
            "rope_theta": float(self._arch_field("rope.freq_base") or 10000.0),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": self.architecture == "llama" and "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.eos_token_ids(),
            "torch_dtype": "bfloat16",
        }
        config.update(self._rope_scaling())
        return config

    def _rope_scaling(self) -> dict[str, Any]:
        kind = self._arch_field("rope.scaling.type", "none")
        if kind in ("none", None):
            return {}
        if kind == "linear":
            return {"rope_scaling": {"rope_type": "linear", "factor": float(self._required("rope.scaling.factor"))}}
        raise CheckpointError(f"{self.path}: RoPE scaling {kind!r} is not supported from GGUF (only linear)")

    def eos_token_ids(self) -> list[int]:
        """The EOS id, and the end-of-turn id where the file names another one (chat models)."""
        ids = [self.field(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id")]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    @property
    def chat_template(self) -> str | None:
        return self.field("tokenizer.chat_template")

    def special_token_texts(self) -> dict[str, str]:
        """bos_token, eos_token, ... as a chat template sees them."""
        tokens = self.tokens
        names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                 "pad_token": "padding_token_id"}  # fmt: skip
        found = {name: self.field(f"tokenizer.ggml.{key}") for name, key in names.items()}
        return {name: tokens[i] for name, i in found.items() if i is not None and 0 <= i < len(tokens)}

    def hf_names(self) -> dict[str, str]:
        """Hugging Face tensor name -> GGUF tensor name, for every tensor of the file."""
        names = {}
        for name in self.tensors:
            hf = _hf_name(name)
            if hf is None:
                raise CheckpointError(f"{self.path}: GGUF tensor {name} has no place in a {self.architecture} model")
            names[hf] = name
        return names


def _hf_name(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")  # kind: weight or bias
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    return None


class GGUFTensor:
    """One tensor of a GGUF file under its Hugging Face shape, read as a safetensors slice is (model/checkpoint.py):
    whole, or a range of one dimension, dequantized to float32."""

    def __init__(self, file: GGUFFile, hf_name: str, gguf_name: str, heads: int | None) -> None:
        self.name, self.file = hf_name, file.path
        self._gguf_name = gguf_name
        self._tensor = file.tensors[gguf_name]
        self.shape = tuple(int(n) for n in reversed(self._tensor.shape.tolist()))  # GGUF lists dims innermost first
        self.dtype: str = self._tensor.tensor_type.name  # as stored: F32, BF16, Q4_1, Q8_0, ...
        self._heads = heads  # llama's Q/K: the heads whose rotary halves the converter interleaved

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        if len(self.shape) == 1:
            values = self._dequantized(self._tensor.data)
            return values if dim is None else values[start:start + (length or self.shape[0] - start)]
        if dim is None:
            return self._rows(0, self.shape[0])
        stop = self.shape[dim] if length is None else start + length
        if dim == 0:
            return self._rows(start, stop)
        if dim == 1:
            return self._columns(start, stop)
        raise CheckpointError(f"tensor {self.name} of {self.file}: cannot read along dimension {dim}")

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        if self._heads is None:
            return self._dequantized(self._tensor.data[start:stop])
        order = _unpermuted_rows(self.shape[0], self._heads)[start:stop]
        low, high = int(order.min()), int(order.max()) + 1
        return self._dequantized(self._tensor.data[low:high])[order - low]

    def _columns(self, start: int, stop: int) -> torch.Tensor:
        """Columns [start, stop) of every row: only the quantization blocks that hold them are dequantized."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES

        block, block_bytes = GGML_QUANT_SIZES[self._tensor.tensor_type]
        first, last = start // block, -(-stop // block)
        data = self._tensor.data
        unit = block_bytes if data.dtype == np.uint8 else 1  # quantized rows are bytes; F32/F16 rows are values
        chunk = data[:, first * unit:last * unit]
        if self._heads is not None:
            chunk = chunk[_unpermuted_rows(self.shape[0], self._heads)]
        return self._dequantized(chunk)[:, start - first * block:stop - first * block]

    def _dequantized(self, data: np.ndarray) -> torch.Tensor:
        import numpy as np
        import torch
        from gguf.quants import dequantize

        kind = self._tensor.tensor_type
        fast = _dequantized_in_torch(data, kind.name)
        if fast is not None:
            return fast
        try:
            values = dequantize(np.ascontiguousarray(data), kind)
        except NotImplementedError as exc:
            raise CheckpointError(f"{self.file}: tensor {self._gguf_name} is stored as {kind.name}, a type the gguf "
                                  "library cannot dequantize") from exc  # fmt: skip
        values = np.ascontiguousarray(values, dtype=np.float32)
        return torch.from_numpy(values if values.flags.writeable else values.copy())  # F32 is a view of the map


# Bytes of one 32-value block: Q8_0 = float16 scale + 32 int8; Q4_1 = float16 scale and minimum + 16 bytes of nibbles.
_TORCH_BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20}


def _dequantized_in_torch(data: np.ndarray, kind: str) -> torch.Tensor | None:
    """Rows of Q8_0 or Q4_1 blocks dequantized as the gguf library does, bit for bit (the same float32 products and
    sums, in the same order: x * d; d * q + m with a block's low nibbles first), as whole-tensor torch ops rather than
    the library's row groups; None for any other type."""
    import numpy as np
    import torch

    size = _TORCH_BLOCK_BYTES.get(kind)
    if size is None or data.dtype != np.uint8:
        return None
    rows = data.shape[0] if data.ndim == 2 else 1
    blocks = torch.from_numpy(np.array(data, copy=True)).view(-1, size)  # a copy: the file's map is read-only
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    if kind == "Q8_0":
        values = blocks[:, 2:].contiguous().view(torch.int8).float() * d
    else:
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()
        nibbles = blocks[:, 4:]
        values = d * torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1).float() + m
    return values.view(rows, -1) if data.ndim == 2 else values.view(-1)


def _unpermuted_rows(rows: int, heads: int) -> np.ndarray:
    """For each Hugging Face row of a Llama Q/K weight, the GGUF row that holds it: llama.cpp's converter
    stores each head's rotary halves interleaved (row 2i + j of a head holds its row j * head_dim / 2 + i)."""
    import numpy as np

    half = rows // heads // 2
    return np.arange(rows).reshape(heads, 2, half).transpose(0, 2, 1).reshape(-1).argsort()


class GGUFReader:
    """The checkpoint reader (model/checkpoint.py's interface) of a GGUF file: tensors by Hugging Face name."""

    def __init__(self, file: GGUFFile) -> None:
        self.gguf = file
        self.folder = file.path
        self._names = file.hf_names()
        self.weight_map = dict.fromkeys(self._names, file.path)
        config = file.hf_config()
        self._heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self._names:
            raise CheckpointError(f"tensor {name} is missing from the GGUF file {self.folder}")
        projection = name.split(".")[-2]
        permuted = self.gguf.architecture == "llama" and projection in self._heads and name.endswith(".weight")
        return GGUFTensor(self.gguf, name, self._names[name], self._heads[projection] if permuted else None)

    raw_tensor = tensor

    def close(self) -> None:
        self._names.clear()


def build_tokenizer(file: GGUFFile) -> Tokenizer:
    """The file's BPE tokenizer, built with the tokenizers library from the vocabulary, merges and token types."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    kind, pre = file.field("tokenizer.ggml.model"), file.field("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise CheckpointError(f"{file.path}: GGUF tokenizer model {kind!r} is not supported (only gpt2, byte-level "
                              "BPE); pass --tokenizer with the model's tokenizer.json")  # fmt: skip
    if pre not in PRE_TOKENIZER_SPLITS:
        raise CheckpointError(f"{file.path}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
                              f"{', '.join(PRE_TOKENIZER_SPLITS)}); pass --tokenizer with the model's tokenizer.json")
    tokens = file.tokens
    merges = [tuple(m.split(" ", 1)) for m in file.field("tokenizer.ggml.merges") or []]
    tokenizer = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in PRE_TOKENIZER_SPLITS[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                         use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    types = file.field("tokenizer.ggml.token_type") or []
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, t in enumerate(types) if t == _USER_DEFINED])  # fmt: skip
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(types) if t == _CONTROL])  # fmt: skip
    bos = file.field("tokenizer.ggml.bos_token_id")
    if file.field("tokenizer.ggml.add_bos_token", False) and bos is not None:
        text = tokens[bos]
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{text} $A", pair=f"{text} $A {text} $B",
                                                                 special_tokens=[(text, bos)])  # fmt: skip
    return tokenizer


def save_tokenizer_files(file: GGUFFile, folder: Path, model_max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json (chat template, special tokens) of the file, as a Hugging Face
    folder carries them."""
    import json

    build_tokenizer(file).save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": file.chat_template,
              "model_max_length": model_max_length, **file.special_token_texts()}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_hf_folder(path: str | Path, folder: str | Path) -> Path:
    """The GGUF file as a Hugging Face folder of bfloat16 safetensors (config, tokenizer, chat template), each
    tensor dequantized and rounded as dtype auto holds it, so that servers which read only such folders (vLLM,
    llama.cpp's converter) serve the weights our engine serves. Written once: a complete folder is reused."""
    import json

    import torch
    from safetensors.torch import save_file

    file, folder = open_gguf(path), Path(folder)
    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = file.hf_config()
    reader = GGUFReader(file)
    tensors = {name: reader.tensor(name).read().to(torch.bfloat16).contiguous() for name in reader.weight_map}
    save_tokenizer_files(file, folder, config["max_position_embeddings"])
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "silu"}, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors.partial"), metadata={"format": "pt"})
    (folder / "model.safetensors.partial").rename(folder / "model.safetensors")
    return folder
