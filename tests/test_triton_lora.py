"""Batched LoRA's Triton kernels (model/triton_lora.py) against lora.py's torch math, on CPU through Triton's
interpreter: packed q/k/v and gate/up projections and a row-parallel one, a tensor-parallel rank's share,
three adapters of ranks 8 and 16 (one on some parts only) mixed with tokens of none, batches of one token
and of several tiles.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from minedraft.model.layers import (  # noqa: E402
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minedraft.model.lora import ADAPTED_LAYERS, LoraAdapter, LoraSlots, TokenSlots, lora_kernel_available  # noqa: E402
from minedraft.model.parallel import TensorParallel  # noqa: E402

HIDDEN, MAX_RANK = 32, 16
# (adapter rank, parts it adapts: None for all)
ADAPTERS = [(8, None), (16, None), (8, ("q_proj", "v_proj", "up_proj"))]


def _layers(tp: TensorParallel) -> dict[str, LinearBase]:
    return {
        "qkv_proj": QKVParallelLinear(HIDDEN, 8, num_heads=4, num_kv_heads=2, bias=False, tp=tp,
                                      batch_invariant=False),
        "gate_up_proj": MergedColumnParallelLinear(HIDDEN, [40, 40], bias=False, tp=tp, batch_invariant=False),
        "down_proj": RowParallelLinear(48, HIDDEN, bias=False, tp=tp, batch_invariant=False),
    }  # fmt: skip


def _adapter(index: int, rank: int, parts: tuple[str, ...] | None, shapes: dict[str, tuple[int, int]],
             gen: torch.Generator) -> LoraAdapter:
    """Random full (unsplit) A [r, in] and B [out, r] for each part named, as an adapter's file holds them."""
    weights = {f"layer.{part}": (torch.randn(rank, inp, generator=gen), torch.randn(out, rank, generator=gen))
               for part, (out, inp) in shapes.items() if parts is None or part in parts}  # fmt: skip
    return LoraAdapter(f"adapter{index}", rank, 2.0 / rank, weights)


def _full_shapes(name: str, layer: LinearBase, tp: TensorParallel) -> dict[str, tuple[int, int]]:
    """Each part's full (out, in), as the checkpoint holds it, for this layer built on `tp`."""
    shapes = {}
    for part, shard_id in ADAPTED_LAYERS[name]:
        dim, _, length, full, _ = layer.shard(shard_id)
        out, inp = layer.weight.shape
        shapes[part] = (full, inp) if dim == 0 else (out, inp * tp.size)
    return shapes


def _pool(name: str, tp: TensorParallel, gen: torch.Generator) -> LoraSlots:
    """The layer's pool with the three adapters in slots 1-3 (slot 0: no adapter)."""
    layer = _layers(tp)[name]
    pool = LoraSlots(layer, ADAPTED_LAYERS[name], TokenSlots(), len(ADAPTERS) + 1, MAX_RANK)
    shapes = _full_shapes(name, layer, tp)
    for index, (rank, parts) in enumerate(ADAPTERS):
        pool.load(index + 1, "layer", _adapter(index, rank, parts, shapes, gen))
    return pool


def _both_paths(pool: LoraSlots, slots: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(len(slots), pool.a.shape[1], generator=gen)
    y = torch.randn(len(slots), pool.b.shape[0], generator=gen)
    pool.tokens.set(torch.tensor(slots, dtype=torch.int64))
    pool.kernel = False
    expected = pool.add_to(y.clone(), x)
    pool.kernel = True
    return pool.add_to(y.clone(), x), expected


@pytest.mark.parametrize("name", ["qkv_proj", "gate_up_proj", "down_proj"])
@pytest.mark.parametrize("rank_of", [(0, 1), (1, 2)], ids=["tp1", "tp2-rank1"])
def test_kernel_equals_torch_math(name, rank_of):
    gen = torch.Generator().manual_seed(7)
    pool = _pool(name, TensorParallel(rank=rank_of[0], size=rank_of[1]), gen)
    mixed = [0, 1, 2, 3, 2, 0, 3, 1, 1] * 5  # 45 tokens: two tiles of rows, every slot in both
    for slots in ([2], [0], [3], mixed[:7], mixed):
        got, expected = _both_paths(pool, slots, gen)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_tokens_without_adapter_keep_the_base_output_exactly():
    gen = torch.Generator().manual_seed(3)
    pool = _pool("qkv_proj", TensorParallel(), gen)
    x, y = torch.randn(5, HIDDEN, generator=gen), torch.randn(5, pool.b.shape[0], generator=gen)
    pool.tokens.set(torch.tensor([0, -1, 2, 0, -1]))
    pool.kernel = True
    got = pool.add_to(y.clone(), x)
    assert torch.equal(got[[0, 1, 3, 4]], y[[0, 1, 3, 4]])
    assert not torch.equal(got[2], y[2])


def test_kernel_rounds_as_the_torch_path_in_bf16():
    gen = torch.Generator().manual_seed(5)
    pool = _pool("gate_up_proj", TensorParallel(), gen)
    pool.a, pool.b = pool.a.bfloat16(), pool.b.bfloat16()
    x = torch.randn(9, HIDDEN, generator=gen).bfloat16()
    y = torch.randn(9, pool.b.shape[0], generator=gen).bfloat16()
    pool.tokens.set(torch.tensor([1, 0, 2, 3, 3, 1, 0, 2, 1]))
    pool.kernel = False
    expected = pool.add_to(y.clone(), x)
    pool.kernel = True
    got = pool.add_to(y.clone(), x)
    torch.testing.assert_close(got, expected, atol=2**-5 * expected.abs().max().item(), rtol=1.6e-2)


def test_kernel_chosen_only_on_cuda_in_the_default_mode():
    assert not lora_kernel_available(torch.device("cpu"), batch_invariant=False)
    assert not lora_kernel_available(torch.device("cuda"), batch_invariant=True)
    assert lora_kernel_available(torch.device("cuda"), batch_invariant=False)  # triton is installed here
