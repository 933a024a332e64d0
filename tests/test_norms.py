"""RMS norms in float32 run as torch's `F.rms_norm` (one call instead of eight ops): it must stay Hugging Face's
op order bit for bit, at decode, verification and prompt sizes, with and without the weight."""

from __future__ import annotations

import pytest
import torch

from minedraft.model.layers import RMSNorm, rms_normalize


def _hugging_face(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LlamaRMSNorm / Qwen3RMSNorm's forward, written out."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    normed = normed.to(x.dtype)
    return normed if weight is None else weight * normed


@pytest.mark.parametrize("shape", [(1, 256), (8, 256), (40, 6, 64), (300, 4096), (2, 3, 128)])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_float32_norms_are_hugging_faces_bit_for_bit(shape: tuple[int, ...], eps: float) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * 3
    norm = RMSNorm(shape[-1], eps)
    norm.weight.data = torch.randn(shape[-1], generator=gen)
    assert torch.equal(norm(x), _hugging_face(x, norm.weight, eps))
    assert torch.equal(rms_normalize(x, eps), _hugging_face(x, None, eps))


def test_half_precision_norms_keep_the_float32_sums() -> None:
    x = torch.randn(8, 256).to(torch.bfloat16)
    weight = torch.randn(256).to(torch.bfloat16)
    assert torch.equal(rms_normalize(x, 1e-6), _hugging_face(x, None, 1e-6))
    norm = RMSNorm(256, 1e-6)
    norm.weight.data = weight
    assert torch.equal(norm(x), _hugging_face(x, weight, 1e-6))
