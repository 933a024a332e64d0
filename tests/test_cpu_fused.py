"""The CPU fused layer kernels (model/kernels/cpu_fused.py, C in model/kernels/fused_layers.c) against the torch
ops they replace, row by row alone and in batches, then the model runner with them against the runner without."""

from __future__ import annotations

import random

import pytest
import torch

from minedraft.model.config import RopeConfig
from minedraft.model.kernels import cpu_fused
from minedraft.model.kv_cache import KVCache
from minedraft.model.layers import RotaryEmbedding, rms_normalize
from minedraft.model.runner import ModelRunner, SeqInput

from tiny_models import make_tiny_checkpoint, unfused_qkv

pytestmark = pytest.mark.skipif(cpu_fused.available() is not None, reason=f"no C kernels: {cpu_fused.available()}")


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("hidden", [256, 48, 40])  # 40: a ragged tail after the vector lanes
@pytest.mark.parametrize("rows", [1, 7, 100])  # 100: past the rows that run on the calling thread alone
def test_add_rms_norm_matches_add_then_norm(hidden: int, rows: int) -> None:
    x, residual, weight = _randn(rows, hidden, seed=1), _randn(rows, hidden, seed=2), _randn(hidden, seed=3)
    before = residual.clone()
    normed, stream = cpu_fused.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(stream, x + residual)  # one float32 add, as torch's
    torch.testing.assert_close(normed, weight * rms_normalize(x + residual, 1e-6), atol=1e-5, rtol=1e-5)
    assert torch.equal(residual, before)
    alone = cpu_fused.add_rms_norm(x, None, weight, 1e-6)[0]
    torch.testing.assert_close(alone, weight * rms_normalize(x, 1e-6), atol=1e-5, rtol=1e-5)


def test_add_rms_norm_reads_strided_rows() -> None:
    wide = _randn(5, 96)
    x, residual = wide[:, :64], _randn(5, 96, seed=4)[:, 32:]
    normed, stream = cpu_fused.add_rms_norm(x, residual, torch.ones(64), 1e-5)
    assert torch.equal(stream, x + residual)
    torch.testing.assert_close(normed, rms_normalize(x + residual, 1e-5), atol=1e-5, rtol=1e-5)


def _rope_write(tokens: int, heads: int, kv_heads: int, qk_norm: bool, fused: bool, seed: int = 0):
    """q and both caches after writing `tokens` tokens at scattered cache slots (every other slot -3)."""
    head_dim, block_size = 32, 4
    rotary = RotaryEmbedding(head_dim, RopeConfig(theta=10000.0), max_positions=256)
    rng = random.Random(seed)
    positions = torch.tensor([rng.randrange(200) for _ in range(tokens)])
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=seed + heads + kv_heads)
    norm = (_randn(head_dim, seed=7), _randn(head_dim, seed=8), 1e-6) if qk_norm else None
    num_blocks = tokens // block_size + 3
    cache = KVCache(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=kv_heads,
                    head_dim=head_dim, dtype=torch.float32, device="cpu")  # fmt: skip
    cache.k[0].fill_(-3.0), cache.v[0].fill_(-3.0)
    index = torch.tensor(rng.sample(range(num_blocks * block_size), tokens))
    rope = rotary.table(positions, torch.float32)
    if fused:
        q = cpu_fused.rope_write_kv(qkv, rope, index, cache.k[0], cache.v[0], heads, kv_heads, norm)
    else:
        q, k, v = unfused_qkv(qkv, rope, heads, kv_heads, head_dim, norm)
        cache.write(0, index, k, v)
    return q, cache.k[0], cache.v[0]


@pytest.mark.parametrize(("heads", "kv_heads", "qk_norm"), [(4, 2, False), (4, 4, True), (8, 2, True)])
@pytest.mark.parametrize("tokens", [9, 100])
def test_rope_write_kv_matches_rotate_then_write(heads: int, kv_heads: int, qk_norm: bool, tokens: int) -> None:
    """q rotated as the unfused ops rotate it; k and v in exactly the slots KVCache.write fills, v copied
    bit for bit, every other slot of the pool untouched."""
    q, k_cache, v_cache = _rope_write(tokens, heads, kv_heads, qk_norm, fused=True)
    q_ref, k_ref, v_ref = _rope_write(tokens, heads, kv_heads, qk_norm, fused=False)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache == -3.0, k_ref == -3.0)


def test_a_rows_result_is_the_same_alone_and_in_any_batch() -> None:
    """Bit for bit, below and above the rows that run in parallel: what makes a token's decode step and its
    verification window (or a batch of other sequences) give the same bits here."""
    x, residual, weight = _randn(100, 256, seed=5), _randn(100, 256, seed=6), _randn(256, seed=7)
    whole = cpu_fused.add_rms_norm(x, residual, weight, 1e-6)
    for rows in (slice(3, 4), slice(10, 17), slice(0, 70)):
        part = cpu_fused.add_rms_norm(x[rows], residual[rows], weight, 1e-6)
        assert all(torch.equal(p, w[rows]) for p, w in zip(part, whole, strict=True))
    heads, kv_heads, dim = 8, 2, 32
    qkv = _randn(100, (heads + 2 * kv_heads) * dim, seed=8)
    rope = RotaryEmbedding(dim, RopeConfig(theta=10000.0), max_positions=128).table(torch.arange(100), torch.float32)
    norm = (_randn(dim, seed=9), _randn(dim, seed=10), 1e-6)
    caches = [torch.zeros(kv_heads, 100, dim) for _ in range(4)]
    index = torch.arange(100)
    q_whole = cpu_fused.rope_write_kv(qkv, rope, index, caches[0], caches[1], heads, kv_heads, norm)
    part = slice(10, 17)
    q_part = cpu_fused.rope_write_kv(qkv[part], tuple(t[part] for t in rope), index[part], caches[2], caches[3],
                                     heads, kv_heads, norm)  # fmt: skip
    assert torch.equal(q_part, q_whole[part])
    assert torch.equal(caches[2][:, part], caches[0][:, part]) and torch.equal(caches[3][:, part], caches[1][:, part])


def test_the_kernels_refuse_what_they_do_not_compute() -> None:
    with pytest.raises(ValueError, match="float32 CPU tensors, got torch.bfloat16"):
        cpu_fused.add_rms_norm(torch.ones(2, 64, dtype=torch.bfloat16), None, torch.ones(64), 1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_runner_with_cpu_fused_kernels_matches_the_runner_without(tmp_path, arch: str) -> None:
    """Prefill, decode and a verification window through every layer (Qwen3: its q/k norm fused too), with
    the features an EAGLE head reads (the stream entering a layer, the final normed state)."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch, hidden_size=64, num_layers=2, seed=5)
    runners = {fused: ModelRunner(path, max_seq_len=256, num_slots=2, fused_kernels=fused, aux_hidden_layers=(1, 2))
               for fused in ("off", "cpu")}  # fmt: skip
    assert runners["cpu"].fused_kernels == "cpu" and runners["off"].fused_kernels is None
    rng = random.Random(0)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (3, 150)]  # 150: the kernels' parallel rows
    steps = [[SeqInput(i, p, 0, num_logits=1) for i, p in enumerate(prompts)],
             [SeqInput(i, [7], len(p)) for i, p in enumerate(prompts)],
             [SeqInput(i, [9, 4, 11], len(p) + 1, num_logits=3) for i, p in enumerate(prompts)]]
    for runner in runners.values():
        for _ in prompts:
            runner.allocate_slot()
    for step in steps:
        torch.testing.assert_close(runners["cpu"].forward(step), runners["off"].forward(step), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(runners["cpu"].aux_hidden, runners["off"].aux_hidden, atol=1e-5, rtol=1e-5)
