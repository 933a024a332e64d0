"""LoRA adapters in PEFT's format, many per batch.

An adapter folder holds ``adapter_config.json`` (r, lora_alpha, target_modules, use_rslora) and
``adapter_model.safetensors`` (``...<module>.lora_A.weight`` [r, in], ``...lora_B.weight`` [out, r]).
A projection computes y = x W^T + s (x A^T) B^T, s = alpha / r (alpha / sqrt(r) with rsLoRA).

Batched: each adapted linear layer holds a pool of `max_loras + 1` slots (slot 0 stays zero: no adapter),
every slot `parts x max_rank` columns wide (qkv_proj packs 3 parts, gate_up_proj 2). One forward multiplies
every token by the A of all slots at once, keeps only its own slot's columns (a mask) and multiplies by the
B of all slots: two GEMMs per projection whatever the mix of adapters, and a token without one adds an
exact zero. Tensor parallel: A and B are split the way the base layer is (column-parallel: B along its
output rows; row-parallel: A along its input columns, the partial sums reduced with the base layer's).

On CUDA in the default mode, where triton is installed, the same pools are multiplied by the Triton kernels
of model/kernels/triton_lora.py instead (`lora_kernel_available`): each token by its own slot's A and B only, each
packed part by its own rows of B. The strict mode (batch_invariant) and the CPU keep the two GEMMs above.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from minedraft.model.kernels import triton_module
from minedraft.model.layers import LinearBase, linear

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Our packed layers and the checkpoint projections (with their shard ids) that make them up.
ADAPTED_LAYERS: dict[str, tuple[tuple[str, object], ...]] = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "o_proj": (("o_proj", None),),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    "down_proj": (("down_proj", None),),
}
PROJECTIONS = {name for parts in ADAPTED_LAYERS.values() for name, _ in parts}
_UNSUPPORTED_MODULES = ("embed_tokens", "lm_head")
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")


class LoraError(ValueError):
    """An adapter that cannot be served: the message names what and why."""


@dataclass(frozen=True)
class LoraOptions:
    """The adapters a model may apply: name -> folder, how many at once, and the largest rank."""

    adapters: dict[str, str]
    max_loras: int = 1
    max_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded in host memory (LRU); None: max_loras


@dataclass
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    # module path (model.layers.0.self_attn.q_proj) -> (A [r, in], B [out, r]), full (unsplit), on the host
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def is_adapter_folder(folder: Path) -> bool:
    return (folder / CONFIG_FILE).is_file()


def read_adapter_config(folder: Path, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of the adapter in `folder`; refuses by name what is not implemented."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoraError(f"{folder} is not a LoRA adapter: {CONFIG_FILE} not found")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        rank = int(config["r"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoraError(f"{path}: not a readable PEFT adapter config ({type(exc).__name__}: {exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{folder}: peft_type {config['peft_type']!r} is not supported (LORA only)")
    if config.get("use_dora"):
        raise LoraError(f"{folder}: use_dora (DoRA) is not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{folder}: bias {config['bias']!r} is not supported (only bias 'none')")
    if config.get("modules_to_save"):
        raise LoraError(f"{folder}: modules_to_save {config['modules_to_save']} is not supported")
    targets = config.get("target_modules") or []
    named = [m for m in _UNSUPPORTED_MODULES if (m in targets if isinstance(targets, list) else m in str(targets))]
    if named:
        raise LoraError(f"{folder}: adapters on {', '.join(named)} (embedding / LM head) are not supported")
    alpha = float(config.get("lora_alpha", rank))
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraError(f"{folder}: rank_pattern / alpha_pattern is not supported")
    if rank > max_rank:
        raise LoraError(f"{folder}: rank {rank} exceeds max_lora_rank {max_rank}")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def load_adapter(name: str, folder: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Read an adapter's weights, by module path; each module must be a projection we adapt."""
    path = Path(folder) / WEIGHTS_FILE
    try:
        return _read_pairs(name, path)
    except LoraError:
        raise
    except Exception as exc:  # a missing or truncated file: safetensors' and the OS's own errors
        raise LoraError(f"{path}: cannot read the adapter's weights ({type(exc).__name__}: {exc})") from None


def _read_pairs(name: str, path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(path, framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            match = _TENSOR.fullmatch(key.removeprefix(_PREFIX))
            module = match["module"] if match else key
            if match is None or module.rsplit(".", 1)[-1] not in PROJECTIONS or ".experts." in module:
                raise LoraError(f"adapter {name!r}: tensor {key} is not a LoRA weight of q/k/v/o or "
                                "gate/up/down projections (the only ones supported)")
            pairs.setdefault(module, {})[match["ab"]] = handle.get_tensor(key)
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: {module} has lora_{next(iter(ab))} without its pair")
    return {module: (ab["A"], ab["B"]) for module, ab in pairs.items()}  # type: ignore[return-value]


def lora_kernel_available(device: torch.device, batch_invariant: bool) -> bool:
    """Whether the adapters run as Triton kernels (model/kernels/triton_lora.py): on CUDA, in the default mode, where
    triton is installed. Elsewhere the torch GEMMs of `LoraSlots.add_to` do."""
    return device.type == "cuda" and not batch_invariant and triton_module("triton_lora", "lora", "auto") is not None


class TokenSlots:
    """Each token's adapter slot for the forward under way (shared by every adapted layer of a model)."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None  # [tokens] int64; None: no token has an adapter
        self._masks: dict[int, torch.Tensor] = {}

    def set(self, slots: torch.Tensor | None) -> None:
        self.slots, self._masks = slots, {}

    def mask(self, width: int, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, num_slots * width]: 1 in the columns of each token's slot (once per width per forward)."""
        if width not in self._masks:
            assert self.slots is not None
            columns = torch.arange(num_slots * width, device=self.slots.device) // width
            self._masks[width] = (self.slots[:, None] == columns).to(dtype)
        return self._masks[width]


class LoraSlots:
    """One linear layer's adapter pool: A stacked as [slots * width, in], B as [out, slots * width]."""

    def __init__(self, layer: LinearBase, parts: tuple[tuple[str, object], ...], tokens: TokenSlots,
                 num_slots: int, max_rank: int) -> None:
        self.layer, self.parts, self.tokens = layer, parts, tokens
        self.num_slots, self.max_rank, self.width = num_slots, max_rank, len(parts) * max_rank
        # Built before the weights are packed (runner): the dense or quantized weight gives the shape.
        weight = layer.weight
        out, inp = layer.quantized.shape if layer.quantized is not None else weight.shape
        self.a = torch.zeros(num_slots * self.width, inp, dtype=weight.dtype, device=weight.device)
        self.b = torch.zeros(out, num_slots * self.width, dtype=weight.dtype, device=weight.device)
        # Each part's output rows in this rank's B (first, count), for the kernel's per-part expand.
        rows = [(offset, length) if dim == 0 else (0, out)
                for dim, offset, length, _, _ in (layer.shard(shard_id) for _, shard_id in parts)]
        self.part_rows = torch.tensor(rows, dtype=torch.int32, device=weight.device)
        self.longest_part = max(length for _, length in rows)
        self.kernel = lora_kernel_available(weight.device, layer.batch_invariant)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.tokens.slots is None:
            return y
        if self.kernel:
            from minedraft.model.kernels.triton_lora import add_lora  # triton is imported only where it runs

            return add_lora(y, x, self.a, self.b, self.tokens.slots, self.part_rows, self.longest_part,
                            self.max_rank)
        h = linear(x, self.a, None, self.layer.batch_invariant)
        h = h * self.tokens.mask(self.width, self.num_slots, h.dtype)
        return y + linear(h, self.b, None, self.layer.batch_invariant)

    def load(self, slot: int, module: str, adapter: LoraAdapter) -> None:
        """Write this layer's part of `adapter` (module: its path without the part name) into `slot`."""
        for index, (part, shard_id) in enumerate(self.parts):
            columns = slice(slot * self.width + index * self.max_rank, slot * self.width + (index + 1) * self.max_rank)
            self.a[columns].zero_()
            self.b[:, columns].zero_()
            pair = adapter.weights.get(f"{module}.{part}")
            if pair is None:
                continue
            a, b = pair
            dim, offset, length, _, start = self.layer.shard(shard_id)
            r = adapter.rank
            b = b * adapter.scaling
            if dim == 0:  # column-parallel: this rank's output rows of B
                self.a[columns][:r].copy_(a)
                self.b[offset : offset + length, columns][:, :r].copy_(b[start : start + length])
            else:  # row-parallel: this rank's input columns of A
                self.a[columns][:r, offset : offset + length].copy_(a[:, start : start + length])
                self.b[:, columns][:, :r].copy_(b)


class LoraManager:
    """A model's adapters: the registered folders, those loaded on the host (LRU, max_cpu_loras) and those in
    the model's slots (LRU, max_loras). Every tensor-parallel rank sees the same batches, so takes the same
    decisions."""

    def __init__(self, model: nn.Module, options: LoraOptions) -> None:
        if options.max_loras < 1 or options.max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        self.options = options
        self.configs = {name: read_adapter_config(Path(path), options.max_rank)
                        for name, path in options.adapters.items()}  # refuse bad adapters at start-up
        self.tokens = TokenSlots()
        self.layers: dict[str, LoraSlots] = {}  # by the module path its parts sit under (model.layers.0.mlp)
        for path, module in model.named_modules():
            parts = ADAPTED_LAYERS.get(path.rsplit(".", 1)[-1])
            if parts is not None and isinstance(module, LinearBase):
                module.lora = self.layers[path] = LoraSlots(
                    module, parts, self.tokens, options.max_loras + 1, options.max_rank)
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._slots: OrderedDict[str, int] = OrderedDict()  # adapter -> slot 1..max_loras, least recent first
        for name in options.adapters:  # read every adapter once: a bad one is refused at start-up, not mid-step
            self._adapter(name)

    @property
    def kernel(self) -> bool:
        """Whether the adapters run as Triton kernels (then CUDA graphs may capture them: model/graphs.py)."""
        return all(slots.kernel for slots in self.layers.values())

    def add(self, name: str, folder: str) -> None:
        """Register (or replace) adapter `name` while serving: read and check it whole first, so a bad folder is
        refused (LoraError naming the file) and changes nothing. A replaced adapter leaves its slot."""
        rank, scaling = read_adapter_config(Path(folder), self.options.max_rank)
        adapter = LoraAdapter(name, rank, scaling, load_adapter(name, folder))
        self._check_modules(adapter)
        self.remove(name)
        self.options.adapters[name], self.configs[name] = folder, (rank, scaling)
        self._keep(adapter)

    def remove(self, name: str) -> None:
        """Forget adapter `name` (no sequence may run through it any more); its slot is free for another."""
        self.options.adapters.pop(name, None)
        self.configs.pop(name, None)
        self._loaded.pop(name, None)
        self._slots.pop(name, None)

    def check(self, name: str) -> None:
        if name not in self.options.adapters:
            raise LoraError(f"unknown LoRA adapter {name!r} (registered: {sorted(self.options.adapters)})")

    def activate(self, names: list[str | None]) -> list[int]:
        """The slot of each name (0 for None), loading adapters into slots the batch does not need."""
        wanted = list(dict.fromkeys(n for n in names if n is not None))
        if len(wanted) > self.options.max_loras:
            raise LoraError(f"{len(wanted)} adapters in one batch exceed max_loras {self.options.max_loras}")
        for name in wanted:
            if name in self._slots:
                self._slots.move_to_end(name)
            else:
                self._slots[name] = self._free_slot(set(wanted))
                self._write(self._slots[name], self._adapter(name))
        return [0 if n is None else self._slots[n] for n in names]

    def _free_slot(self, keep: set[str]) -> int:
        used = set(self._slots.values())
        free = [s for s in range(1, self.options.max_loras + 1) if s not in used]
        if free:
            return free[0]
        victim = next(n for n in self._slots if n not in keep)
        return self._slots.pop(victim)

    def _adapter(self, name: str) -> LoraAdapter:
        self.check(name)
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return self._loaded[name]
        rank, scaling = self.configs[name]
        adapter = LoraAdapter(name, rank, scaling, load_adapter(name, self.options.adapters[name]))
        self._check_modules(adapter)
        self._keep(adapter)
        return adapter

    def _keep(self, adapter: LoraAdapter) -> None:
        """Hold `adapter` on the host, dropping the least recently used past max_cpu_loras (an adapter in a slot
        keeps serving from there; it is read again from its folder when it needs a slot once more)."""
        self._loaded[adapter.name] = adapter
        while len(self._loaded) > max(self.options.max_cpu_loras or 0, self.options.max_loras):
            self._loaded.popitem(last=False)

    def _check_modules(self, adapter: LoraAdapter) -> None:
        known = {f"{_parent(path)}.{part}" for path, slots in self.layers.items() for part, _ in slots.parts}
        unknown = sorted(set(adapter.weights) - known)
        if unknown:
            raise LoraError(f"adapter {adapter.name!r}: modules {unknown[:3]} are not in this model")
        for module, (a, b) in adapter.weights.items():
            if a.shape[0] != adapter.rank or b.shape[1] != adapter.rank:
                raise LoraError(f"adapter {adapter.name!r}: {module} has rank {a.shape[0]}, its config says "
                                f"{adapter.rank}")

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        with torch.no_grad():
            for path, slots in self.layers.items():
                slots.load(slot, _parent(path), adapter)


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0]
