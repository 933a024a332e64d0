"""Tokenizer: a thin wrapper over a fast tokenizer.json; needs no torch and no model."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from minedraft.model.checkpoint import CheckpointError, CheckpointNotFoundError, resolve_checkpoint
from minedraft.model.gguf import build_tokenizer, is_gguf, open_gguf
from minedraft.model.hub import local_folder

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    def __init__(self, backend: _HFTokenizer) -> None:
        self._tok = backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids with the tokenizer.json post-processor applied (e.g. Llama's BOS) unless told not to
        (a rendered chat template already holds its special tokens)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_concurrently(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `encode`, through the library's batch path, which releases the GIL: a long prompt
        tokenized in a worker thread then does not stall the other threads (the step loop, the event loop)."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def backend(self) -> _HFTokenizer:
        """The tokenizers library's object (the grammar library reads the vocabulary from it)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load <path>/tokenizer.json (path may also be the file itself, a hub id: model/hub.py, or a GGUF checkpoint:
    its tokenizer.json if one lies beside the file, else the tokenizer its metadata describes)."""
    if not str(path).endswith(TOKENIZER_FILE) and not (local_folder(path) / TOKENIZER_FILE).is_file():
        checkpoint = gguf_checkpoint(path)
        if checkpoint is not None:
            beside = checkpoint.parent / TOKENIZER_FILE
            return load_tokenizer(beside) if beside.is_file() else Tokenizer(build_tokenizer(open_gguf(checkpoint)))
    path = local_folder(path)
    file = path if path.is_file() else path / TOKENIZER_FILE
    if not path.exists():
        raise CheckpointNotFoundError(f"tokenizer folder not found: {path}")
    if not file.is_file():
        raise CheckpointNotFoundError(
            f"{TOKENIZER_FILE} not found in {path} (only fast tokenizers saved as {TOKENIZER_FILE} are supported)"
        )
    try:
        return Tokenizer(_HFTokenizer.from_file(str(file)))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"cannot load {file}: {exc}") from exc


def gguf_checkpoint(path: str | Path) -> Path | None:
    """The GGUF file `path` names (a packaged model, a .gguf, a folder holding one), or None."""
    try:
        checkpoint = resolve_checkpoint(path)
    except CheckpointNotFoundError:
        return None
    return checkpoint if is_gguf(checkpoint) else None
