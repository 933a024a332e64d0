"""The LoRA adapters an engine serves, and their loads and unloads while it serves (`LLMEngine.load_lora`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from minedraft.config import EngineConfig, LoraModule
from minedraft.engine.plans import Executor, StepResult


class LoraRefused(ValueError):
    """A run-time LoRA load or unload the engine refuses: `kind` is off (not enabled), invalid (a bad name, path
    or folder), exists (a name already served) or not_found (a name not served); the message says why."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


LoraDone = Callable[[LoraRefused | None], None]


def rooted(path: str, root: str, name: str) -> str:
    """`path` (absolute, or relative to `root`) as an absolute path, if it lies inside `root`. Only the words of
    the path are compared (the workers read the folder; this process may not see it)."""
    base = os.path.normpath(os.path.abspath(root))
    full = os.path.normpath(os.path.join(base, path))
    if os.path.commonpath([full, base]) != base:
        raise LoraRefused("invalid", f"{name} {path!r} is outside lora_root ({root}): adapters are loaded from there "
                          "only")  # fmt: skip
    return full


class LoraAdapters:
    """The adapters served (run-time loads included), the loads sent to the workers and waiting for their word,
    and the unloads waiting for their requests to finish. Changes reach the workers through the executor, with
    its next step."""

    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.modules = {m.name: m for m in config.lora_modules}
        self._loading: dict[str, LoraDone] = {}
        self._closing: dict[str, LoraDone] = {}

    @property
    def names(self) -> list[str]:
        """The adapters a new request may run through: not one still loading, nor one being unloaded."""
        return [n for n in self.modules if n not in self._loading and n not in self._closing]

    def check(self, name: str | None) -> str | None:
        """A request's adapter, if it is served (None: the base model); else ValueError."""
        if name is not None and name not in self.names:
            raise ValueError(f"unknown LoRA adapter {name!r}: this server has {self.names or 'none'}")
        return name

    def load(self, module: LoraModule, done: LoraDone) -> None:
        """See `LLMEngine.load_lora`."""
        root = self._check_updating()
        if module.name in self.modules:
            raise LoraRefused("exists", f"LoRA adapter {module.name!r} is already loaded: unload it first")
        draft = module.draft_path and rooted(module.draft_path, root, "draft_path")
        spec = self.config.speculative_config
        if draft and spec is not None and (self.config.uses_eagle_head or spec.parallel_drafting
                                           or self.config.drafts_without_model):  # fmt: skip
            raise LoraRefused("invalid", "draft_path: a drafter adapter is for draft-model drafting, not EAGLE heads "
                              "or PARD (parallel_drafting)")  # fmt: skip
        module = LoraModule(name=module.name, path=rooted(module.path, root, "lora_path"), draft_path=draft or None)
        self.modules[module.name] = module
        self._loading[module.name] = done
        self.executor.change_loras([module])

    def unload(self, name: str, done: LoraDone, in_use: Iterable[str | None]) -> None:
        """See `LLMEngine.unload_lora`; `in_use`: the adapters of the engine's requests."""
        self._check_updating()
        if name not in self.names:
            raise LoraRefused("not_found", f"LoRA adapter {name!r} is not loaded (loaded: {self.names})")
        self._closing[name] = done
        self.settle(in_use)

    def settle(self, in_use: Iterable[str | None]) -> None:
        """Finish each unload whose adapter no request uses any more (`in_use`: the adapters of the engine's
        requests, running, waiting or held)."""
        if not self._closing:
            return
        used = set(in_use)
        for name in [n for n in self._closing if n not in used]:
            del self.modules[name]
            self.executor.change_loras([name])
            self._closing.pop(name)(None)

    def loaded(self, result: StepResult | None) -> None:
        """The workers' word on the loads a step carried: a load one of them refused is undone everywhere."""
        for name, error in (result.lora_loaded if result is not None else {}).items():
            done = self._loading.pop(name, None)
            if done is None:
                continue
            if error:
                del self.modules[name]
                self.executor.change_loras([name])
            done(LoraRefused("invalid", error) if error else None)

    def send_loading_again(self) -> None:
        """After a restart over a new world: the loads still waiting go with its next step again (its join brought
        the adapters; the workers' word on them comes with that step)."""
        if self._loading:
            self.executor.change_loras([self.modules[n] for n in self._loading])

    def _check_updating(self) -> str:
        if not (self.config.allow_runtime_lora_updating and self.config.lora_root):
            raise LoraRefused("off", "loading and unloading LoRA adapters at run time is off on this server (start it "
                              "with --enable-lora --allow-runtime-lora-updating --lora-root DIR)")  # fmt: skip
        return self.config.lora_root
