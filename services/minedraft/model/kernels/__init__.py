"""The model's kernels: the CPU ones in C, the GPU ones in Triton, each beside the Python that calls it.

- CPU, built on first use with the machine's C compiler (cpu_kernels.py) and called through ctypes:
  paged attention (cpu_attention.py, paged_attention.c), the layers' fused elementwise chains (cpu_fused.py,
  fused_layers.c) and a step's whole layer stack as one call (cpu_stack.py, decode_stack.c); the C sources
  share their vector types through vec.h.
- GPU (Triton): paged attention (triton_attention.py), the fused layer chains (triton_fused.py), batched LoRA
  (triton_lora.py), the quantized GEMMs (triton_quant.py) and the grouped MoE expert GEMMs (triton_moe.py).
  They import triton at module level: the model imports them only where they run (triton_module).

Which of them a model runs, as its runner's settings choose: choice.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def triton_module(name: str, setting: str, kernel: str) -> ModuleType | None:
    """The Triton kernels' module `name` (kernels/<name>.py), or None where triton is not installed; a ValueError
    then where `setting` asked for triton by name (`kernel`)."""
    try:
        return importlib.import_module(f"minedraft.model.kernels.{name}")
    except ImportError as exc:
        if kernel == "triton":
            raise ValueError(f"{setting} triton needs the triton package: {exc}") from exc
        return None


def rope_write_inputs(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
                      v_cache: torch.Tensor, rows: Callable[[torch.Tensor], torch.Tensor],
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Both rope_write_kv kernels' checked inputs: (qkv, cos, signed sin) as rows (`rows`: that kernel's own
    layout check) and head_dim, from the caches, which must be contiguous."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_write_kv writes a contiguous KV pool")
    qkv = rows(qkv)
    cos, signed_sin = (rows(t) for t in rope)
    return qkv, cos, signed_sin, k_cache.shape[-1]
