"""The fused layer kernels (model/kernels/triton_fused.py) against the torch ops they replace, on CPU through
Triton's interpreter, then the model runner with them against the runner without.

The interpreter converts fp32 to bf16 by truncation where a GPU rounds to nearest, so bf16 results may
differ from torch's by one unit in the last place: bf16 is compared at bf16's tolerance, fp32 closely.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from minedraft.model.config import RopeConfig  # noqa: E402
from minedraft.model.graphs import StaticForward  # noqa: E402
from minedraft.model.kernels.triton_fused import add_rms_norm, rope_write_kv, silu_and_mul  # noqa: E402
from minedraft.model.kv_cache import KVCache  # noqa: E402
from minedraft.model.layers import RotaryEmbedding, rms_normalize  # noqa: E402
from minedraft.model.runner import ModelRunner, SeqInput  # noqa: E402

from tiny_models import make_tiny_checkpoint, unfused_qkv  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: closely. bf16: within two units in the last place of the largest value (each truncation the
    interpreter makes where torch rounds can cost one)."""
    assert got.dtype == expected.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, expected, atol=2**-6 * expected.abs().max().item(), rtol=1.6e-2)


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 48])  # 48: a row that is not a power of two
def test_add_rms_norm_matches_add_then_norm(dtype: torch.dtype, hidden: int) -> None:
    x, residual = _randn(7, hidden, dtype=dtype, seed=1), _randn(7, hidden, dtype=dtype, seed=2)
    weight = _randn(hidden, dtype=dtype, seed=3)
    normed, stream = add_rms_norm(x, residual, weight, 1e-6)
    expected_stream = x + residual
    _assert_close(stream, expected_stream)
    _assert_close(normed, weight * rms_normalize(expected_stream, 1e-6))
    _assert_close(add_rms_norm(x, None, weight, 1e-6)[0], weight * rms_normalize(x, 1e-6))


def test_add_rms_norm_reads_strided_rows_and_leaves_its_inputs() -> None:
    wide = _randn(5, 96, dtype=torch.float32)
    x, residual, weight = wide[:, :64], _randn(5, 64, dtype=torch.float32, seed=4), torch.ones(64)
    before = residual.clone()
    normed, stream = add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(normed, rms_normalize(x + residual, 1e-5))
    assert torch.equal(residual, before) and stream.data_ptr() != residual.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_gated_mlp(dtype: torch.dtype) -> None:
    gate_up = _randn(3, 2 * 1500, dtype=dtype) * 4  # 1500: more than one program per row, a ragged last one
    gate, up = gate_up.chunk(2, dim=-1)
    _assert_close(silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "qk_norm"), [(4, 2, False), (4, 4, True), (8, 2, True)])
def test_rope_write_kv_matches_rotate_then_write(dtype: torch.dtype, heads: int, kv_heads: int, qk_norm: bool) -> None:
    """q rotated as the unfused ops rotate it; k and v in exactly the slots KVCache.write fills, out-of-order
    blocks included; every other slot of the pool untouched."""
    head_dim, block_size, tokens = 32, 4, 9
    rotary = RotaryEmbedding(head_dim, RopeConfig(theta=10000.0), max_positions=64)
    positions = torch.tensor([0, 1, 2, 3, 4, 17, 18, 40, 5])
    rope = rotary.table(positions, dtype)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=heads + kv_heads)
    norm = (_randn(head_dim, dtype=dtype, seed=7), _randn(head_dim, dtype=dtype, seed=8), 1e-6) if qk_norm else None
    caches = [KVCache(num_layers=1, num_blocks=12, block_size=block_size, num_kv_heads=kv_heads,
                      head_dim=head_dim, dtype=dtype, device="cpu") for _ in range(2)]  # fmt: skip
    for cache in caches:
        cache.k[0].fill_(-3.0), cache.v[0].fill_(-3.0)
    index = torch.tensor([9 * block_size + p for p in range(4)] + [2 * block_size, 5 * block_size + 1,
                                                                   5 * block_size + 2, 11 * block_size + 3, 3])
    q_ref, k_ref, v_ref = unfused_qkv(qkv, rope, heads, kv_heads, head_dim, norm)
    caches[0].write(0, index, k_ref, v_ref)
    q = rope_write_kv(qkv, rope, index, caches[1].k[0], caches[1].v[0], heads, kv_heads, norm)
    _assert_close(q, q_ref)
    _assert_close(caches[1].k[0], caches[0].k[0])
    assert torch.equal(caches[1].v[0], caches[0].v[0])  # v is copied, never rounded
    untouched = torch.ones(caches[1].k[0].shape[1] * block_size, dtype=torch.bool)
    untouched[index] = False
    assert bool((caches[1].k[0].view(kv_heads, -1, head_dim)[:, untouched] == -3.0).all())


# A padded forward's padding tokens belong to no sequence: their attention output is never written (garbage,
# dropped with their rows), and the interpreter warns when the norm squares it.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_runner_with_fused_kernels_matches_the_runner_without(tmp_path, arch: str) -> None:
    """Prefill, decode and a verification window through every layer (Qwen3: its q/k norm fused too),
    with the features an EAGLE head reads (the stream entering a layer, the final normed state); the fused
    runner's decode and verification steps through a CUDA graph's padded forward (graphs.StaticForward)."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch, hidden_size=64, num_layers=2, seed=5)
    runners = {fused: ModelRunner(path, max_seq_len=64, num_slots=2, attention_kernel="triton",
                                  fused_kernels=fused, aux_hidden_layers=(1, 2))
               for fused in ("off", "triton")}  # fmt: skip
    assert runners["triton"].fused_kernels == "triton" and runners["off"].fused_kernels is None
    fused = runners["triton"]
    fused.graphs = StaticForward(fused.model, fused.kv_cache, fused.max_seq_len, fused.device, max_tokens=8)
    rng = random.Random(0)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (3, 21)]
    steps = [[SeqInput(i, p, 0, num_logits=1) for i, p in enumerate(prompts)],
             [SeqInput(i, [7], len(p)) for i, p in enumerate(prompts)],
             [SeqInput(i, [9, 4, 11], len(p) + 1, num_logits=3) for i, p in enumerate(prompts)]]
    for runner in runners.values():
        for _ in prompts:
            runner.allocate_slot()
    for step in steps:
        torch.testing.assert_close(runners["triton"].forward(step), runners["off"].forward(step), atol=1e-4,
                                   rtol=1e-4)  # fmt: skip
        torch.testing.assert_close(runners["triton"].aux_hidden, runners["off"].aux_hidden, atol=1e-5, rtol=1e-5)


def test_fused_kernel_choice(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama", hidden_size=64, num_layers=1, seed=4)
    assert ModelRunner(path, max_seq_len=32).fused_kernels == "cpu"  # auto on CPU: the C kernels
    assert ModelRunner(path, max_seq_len=32, batch_invariant=True).fused_kernels is None  # the strict mode: torch's
    for kernel in ("triton", "cpu"):
        with pytest.raises(ValueError, match=f"fused_kernels {kernel} is not for the strict mode"):
            ModelRunner(path, max_seq_len=32, fused_kernels=kernel, batch_invariant=True)
    with pytest.raises(ValueError, match="fused_kernels cpu runs float32 models on CPU .* dtype torch.bfloat16"):
        ModelRunner(path, max_seq_len=32, fused_kernels="cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="fused_kernels 'fast': use auto, triton, cpu or off"):
        ModelRunner(path, max_seq_len=32, fused_kernels="fast")
