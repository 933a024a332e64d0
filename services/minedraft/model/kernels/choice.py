"""Which of these kernels a model runs, as RunnerOptions' kernel settings choose for its device, dtype and shapes.

Each setting is auto (the kernel where it runs and suits the model, else torch's ops, saying why where that is
a surprise), a kernel by name (refused with the reason where it cannot run), or torch's ops. The strict mode
(batch_invariant) keeps torch's fixed-shape ops throughout.
"""

from __future__ import annotations

import logging

import torch

from minedraft.model.kernels import cpu_attention, cpu_fused, triton_module
from minedraft.model.kernels.cpu_stack import DecodeStack
from minedraft.model.transformer import CausalLM

log = logging.getLogger(__name__)


def triton_attention(kernel: str, device: torch.device, batch_invariant: bool, block_size: int,
                     head_dim: int) -> bool:
    """The paged Triton attention kernel (triton_attention.py), as attention_kernel chooses."""
    if kernel == "torch" or (kernel == "auto" and (device.type != "cuda" or batch_invariant)):
        return False
    module = triton_module("triton_attention", "attention_kernel", kernel)
    return module is not None and (kernel == "triton" or module.supports(block_size, head_dim))


def cpu_attention_kernel(kernel: str, device: torch.device, dtype: torch.dtype, batch_invariant: bool,
                         head_dim: int) -> bool:
    """The C attention kernel for short queries (cpu_attention.py), as attention_kernel chooses."""
    if kernel not in ("auto", "cpu") or batch_invariant:
        return False
    unsuitable = (f"device {device.type}" if device.type != "cpu" else
                  f"dtype {dtype}" if dtype != torch.float32 else
                  f"head_dim {head_dim} (needs a multiple of 16)" if head_dim % 16 else None)  # fmt: skip
    if unsuitable:
        if kernel == "cpu":
            raise ValueError(f"attention_kernel cpu runs float32 models on CPU with head_dim a multiple of 16, "
                             f"not {unsuitable}")
        return False
    reason = cpu_attention.available()
    if reason is not None:
        if kernel == "cpu":
            raise ValueError(f"attention_kernel cpu: {reason}")
        log.warning("attention stays on torch's sdpa path (%s)", reason)
    return reason is None


def fused_layers(kernel: str, device: torch.device, dtype: torch.dtype, torch_ops: bool) -> str | None:
    """Which fused layer kernels run, as fused_kernels chooses: triton, cpu or None (torch's ops, and always where
    `torch_ops`: the strict mode, an EAGLE head)."""
    if kernel == "off" or torch_ops:
        return None
    if kernel == "cpu" or (kernel == "auto" and device.type == "cpu"):
        return _cpu_fused(kernel, device, dtype)
    if kernel == "auto" and device.type != "cuda":
        return None
    return "triton" if triton_module("triton_fused", "fused_kernels", kernel) is not None else None


def _cpu_fused(kernel: str, device: torch.device, dtype: torch.dtype) -> str | None:
    unsuitable = (f"device {device.type}" if device.type != "cpu" else
                  f"dtype {dtype}" if dtype != torch.float32 else None)  # fmt: skip
    reason = unsuitable or cpu_fused.available()
    if reason is not None:
        if kernel == "cpu":
            raise ValueError(f"fused_kernels cpu runs float32 models on CPU where a C compiler builds them, not "
                             f"here: {reason}")
        if unsuitable is None:
            log.warning("the layers keep torch's unfused ops (%s)", reason)
        return None
    return "cpu"


def decode_stack(model: CausalLM, fused: str | None, cpu_attention_runs: bool, lora: bool) -> DecodeStack | None:
    """The layers' one-call form (cpu_stack.py) where the C kernels run and the model allows it, else None."""
    if fused != "cpu" or not cpu_attention_runs or lora:
        return None
    stack, reason = DecodeStack.build(model)
    if stack is None:
        log.info("decode steps run the layers one by one (%s)", reason)
    return stack
