"""Batched LoRA's Triton kernels (model/kernels/triton_lora.py) against lora.py's torch math, on CPU through Triton's
interpreter: packed q/k/v and gate/up projections and a row-parallel one, a tensor-parallel rank's share,
three adapters of ranks 8 and 16 (one on some parts only) mixed with tokens of none, batches of one token
and of several tiles; then a model runner whose adapters run as the kernels, its decode and verification
steps through a CUDA graph's padded forward (graphs.StaticForward), against the runner on the torch path.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from minedraft.model.graphs import StaticForward  # noqa: E402
from minedraft.model.layers import (  # noqa: E402
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minedraft.model.lora import (  # noqa: E402
    ADAPTED_LAYERS,
    LoraAdapter,
    LoraOptions,
    LoraSlots,
    TokenSlots,
    lora_kernel_available,
)
from minedraft.model.parallel import TensorParallel  # noqa: E402
from minedraft.model.runner import ModelRunner, SeqInput  # noqa: E402

from tiny_models import make_tiny_checkpoint  # noqa: E402

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


def test_runner_with_lora_kernels_and_padded_graph_forward(tmp_path):
    """Three adapters (ranks 8 and 16, one on attention only) and a sequence without one in every step."""
    pytest.importorskip("peft")
    from test_lora import make_adapter

    base = make_tiny_checkpoint(tmp_path / "base", "qwen3", hidden_size=64, num_layers=2, seed=3)
    adapters = {"a": make_adapter(base, tmp_path / "a", seed=1, rank=8),
                "b": make_adapter(base, tmp_path / "b", seed=2, rank=16),
                "c": make_adapter(base, tmp_path / "c", seed=3, rank=8, targets=["q_proj", "v_proj", "o_proj"])}
    runners = [ModelRunner(base, max_seq_len=64, num_slots=4, attention_kernel="triton",
                           lora=LoraOptions({n: str(p) for n, p in adapters.items()}, max_loras=3, max_rank=16))
               for _ in range(2)]  # fmt: skip
    eager, kernels = runners
    assert eager.graphs is None and not eager.lora.kernel  # CPU: the torch path, eagerly
    for slots in kernels.lora.layers.values():
        slots.kernel = True
    kernels.graphs = StaticForward(kernels.model, kernels.kv_cache, kernels.max_seq_len, kernels.device,
                                   max_tokens=16)  # fmt: skip
    rng = random.Random(0)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (5, 1, 9, 3)]
    for runner in runners:
        for name in ("a", None, "b", "c"):
            runner.allocate_slot(name)
    steps = [[SeqInput(i, p, 0, num_logits=1) for i, p in enumerate(prompts)],  # eager: a prefill
             [SeqInput(i, [7], len(p)) for i, p in enumerate(prompts)],  # the padded forward: 4 of 8 tokens
             [SeqInput(i, [9, 4, 11], len(p) + 1, num_logits=3) for i, p in enumerate(prompts)]]
    for step in steps:
        torch.testing.assert_close(kernels.forward(step), eager.forward(step), atol=1e-4, rtol=1e-4)
