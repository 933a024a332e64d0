"""The GPU path for quantized checkpoints, without a GPU: the Triton GEMMs (model/kernels/triton_quant.py) under
Triton's interpreter against the CPU path's dequantized weights, and the model runner keeping FP8 and AWQ
weights as stored (QuantizedWeight) against the runner that dequantizes at load.

Both paths round the dequantized weight to the activations' dtype and accumulate in float32, so they
differ only in summation order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from test_quantization import _pack_awq, awq_pair, fp8_pair  # noqa: E402

from minedraft.model.kernels.triton_quant import GemmTiles, awq_matmul, fp8_block_matmul, k_tile  # noqa: E402
from minedraft.model.layers import LinearBase  # noqa: E402
from minedraft.model.quantization import (  # noqa: E402
    DequantizedTensor,
    QuantConfig,
    QuantizedWeight,
    dequantize_awq,
    dequantize_fp8,
)
from minedraft.model.runner import ModelRunner, SeqInput  # noqa: E402

from tiny_models import make_tiny_checkpoint  # noqa: E402

GEN = torch.Generator().manual_seed(0)


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but for summation order and the output's rounding: two units in the last place of the output's
    dtype at the largest value, plus float32 summation in another order (1e-5 of it)."""
    largest = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=(2 * torch.finfo(got.dtype).eps + 1e-5) * largest, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out", "inp", "block"), [(1, 80, 96, (32, 32)), (5, 70, 100, (48, 40)),
                                                           (17, 64, 128, (128, 128))])
def test_fp8_gemm_matches_the_dequantized_weight(dtype, rows: int, out: int, inp: int, block) -> None:
    codes = (torch.randn(out, inp, generator=GEN) * 40).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-out // block[0]), -(-inp // block[1]), generator=GEN) * 0.01 + 0.001
    x = torch.randn(rows, inp, generator=GEN).to(dtype)
    expected = x.float() @ dequantize_fp8(codes, scales, block).to(dtype).float().T
    _assert_close(fp8_block_matmul(x, codes, scales, block), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out", "inp", "group"), [(1, 64, 64, 16), (5, 72, 96, 32), (17, 40, 256, 128)])
def test_awq_gemm_matches_the_dequantized_weight(dtype, rows: int, out: int, inp: int, group: int) -> None:
    qweight = _pack_awq(torch.randint(0, 16, (inp, out), generator=GEN))
    qzeros = _pack_awq(torch.randint(0, 16, (inp // group, out), generator=GEN))
    scales = (torch.rand(inp // group, out, generator=GEN) * 0.02).to(dtype)
    x = torch.randn(rows, inp, generator=GEN).to(dtype)
    expected = x.float() @ dequantize_awq(qweight, qzeros, scales, group, "w").to(dtype).float().T
    _assert_close(awq_matmul(x, qweight, qzeros, scales, group), expected)


@pytest.mark.parametrize("tiles", [GemmTiles(16, 32, 16, split_k=3), GemmTiles(32, 16, 32, split_k=4)])
def test_split_k_adds_up_every_slice(tiles: GemmTiles) -> None:
    """K cut into slices whose partial sums are added afterwards (skinny decode GEMMs on a GPU), with a last
    slice that runs past K: both kernels still give the dequantized product."""
    rows, out, inp = 3, 48, 224  # 224 / 16 = 14 K steps: slices of 5, 5, 4 (or 4, 4, 4, 2)
    codes = (torch.randn(out, inp, generator=GEN) * 40).to(torch.float8_e4m3fn)
    scales = torch.rand(out // 16, inp // 32, generator=GEN) * 0.01 + 0.001
    x = torch.randn(rows, inp, generator=GEN).to(torch.bfloat16)
    expected = x.float() @ dequantize_fp8(codes, scales, (16, 32)).to(torch.bfloat16).float().T
    _assert_close(fp8_block_matmul(x, codes, scales, (16, 32), tiles), expected)
    qweight = _pack_awq(torch.randint(0, 16, (inp, out), generator=GEN))
    qzeros = _pack_awq(torch.randint(0, 16, (inp // 32, out), generator=GEN))
    awq_scales = (torch.rand(inp // 32, out, generator=GEN) * 0.02).to(torch.bfloat16)
    expected = x.float() @ dequantize_awq(qweight, qzeros, awq_scales, 32, "w").to(torch.bfloat16).float().T
    _assert_close(awq_matmul(x, qweight, qzeros, awq_scales, 32, tiles), expected)


def test_a_k_tile_across_two_scales_is_refused() -> None:
    codes = torch.zeros(16, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block_k 64 must divide the scale granularity 32"):
        fp8_block_matmul(torch.zeros(1, 64), codes, torch.ones(1, 2), (16, 32), GemmTiles(block_k=64))


def test_k_tiles_lie_within_one_scale() -> None:
    assert [k_tile(n) for n in (128, 40, 48, 16, 256, 7)] == [64, 8, 16, 16, 64, 1]


def test_where_a_part_lines_up_with_its_scale_blocks() -> None:
    """A q/k/v part or a tensor-parallel shard can be stored quantized only where its blocks (fp8) or its
    packing and groups (awq) start and end with it; elsewhere the layer dequantizes."""
    fp8 = QuantizedWeight(QuantConfig("fp8", block=(16, 16)), 96, 64, torch.float32)
    source = _source(QuantConfig("fp8", block=(16, 16)))
    assert fp8.can_place(source, 0, 32, 32, 64, 0)
    assert not fp8.can_place(source, 0, 40, 32, 64, 0), "offset inside a block"
    assert not fp8.can_place(source, 0, 0, 24, 64, 16), "ends inside a block that goes on"
    ragged = QuantizedWeight(QuantConfig("fp8", block=(16, 16)), 88, 64, torch.float32)
    assert ragged.can_place(source, 0, 80, 8, 24, 16), "a partial last block at the end of both"
    assert not fp8.can_place(source, 0, 80, 8, 24, 16), "a partial last block with more rows after it"
    assert fp8.can_place(source, 1, 0, 64, 64, 0)
    assert not fp8.can_place(_source(QuantConfig("fp8", block=(32, 32))), 0, 0, 32, 64, 0), "other blocks"
    awq = QuantizedWeight(QuantConfig("awq", group_size=32), 96, 64, torch.float32)
    awq_source = _source(QuantConfig("awq", group_size=32))
    assert awq.can_place(awq_source, 0, 8, 16, 64, 8) and not awq.can_place(awq_source, 0, 4, 16, 64, 8)
    assert awq.can_place(awq_source, 1, 0, 32, 64, 32) and not awq.can_place(awq_source, 1, 0, 16, 64, 16)
    assert not QuantizedWeight.can_hold(QuantConfig("awq", group_size=32), 12, 64)


def _source(quant: QuantConfig) -> DequantizedTensor:
    """A checkpoint tensor of that quantization as far as can_place reads it (not its data)."""
    return DequantizedTensor("w", Path("model.safetensors"), (64, 64), None, quant, {})


def _logits(path: Path, kernel: str) -> tuple[torch.Tensor, ModelRunner]:
    runner = ModelRunner(path, num_slots=2, max_seq_len=64, quantized_kernel=kernel)
    ids = torch.randint(0, runner.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    slot = runner.allocate_slot()
    logits = torch.cat([runner.forward([SeqInput(slot, ids[:20], 0, num_logits=20)]),
                        runner.forward([SeqInput(slot, ids[20:], 20, num_logits=10)])])  # fmt: skip
    return logits, runner


def _linears(runner: ModelRunner) -> list[LinearBase]:
    return [m for m in runner.model.modules() if isinstance(m, LinearBase)]


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_the_runner_keeps_quantized_weights_and_gives_the_same_logits(tmp_path, method: str) -> None:
    source = make_tiny_checkpoint(tmp_path / "float", "qwen3", seed=4)
    quantized = fp8_pair(source, tmp_path, block=(16, 16))[0] if method == "fp8" else awq_pair(source, tmp_path)[0]
    kept, runner = _logits(quantized, "triton")
    dense, _ = _logits(quantized, "dequantize")
    torch.testing.assert_close(kept, dense, atol=1e-4, rtol=1e-4)
    layers = _linears(runner)
    assert layers and all(layer.quantized is not None and layer.weight.numel() == 0 for layer in layers)
    stored = layers[0].quantized.parts["weight" if method == "fp8" else "qweight"]
    assert stored.dtype == (torch.float8_e4m3fn if method == "fp8" else torch.int32)


def test_parts_that_do_not_line_up_are_dequantized_and_still_exact(tmp_path) -> None:
    """48 x 40 blocks do not divide the tiny model's q/k/v and gate/up parts: those layers hold dense
    weights, the others stay quantized, and the logits are those of the dequantizing runner."""
    quantized = fp8_pair(make_tiny_checkpoint(tmp_path / "float", "qwen3", seed=4), tmp_path)[0]
    kept, runner = _logits(quantized, "triton")
    torch.testing.assert_close(kept, _logits(quantized, "dequantize")[0], atol=1e-4, rtol=1e-4)
    held = [layer.quantized is not None for layer in _linears(runner)]
    assert any(held) and not all(held)


def test_the_default_dequantizes_on_cpu(tmp_path) -> None:
    quantized = awq_pair(make_tiny_checkpoint(tmp_path / "float", "qwen3", seed=4), tmp_path)[0]
    runner = ModelRunner(quantized, num_slots=1, max_seq_len=16)
    assert not runner.quantized_kernels and all(layer.quantized is None for layer in _linears(runner))
    with pytest.raises(ValueError, match="quantized_kernel 'int4': use auto, triton or dequantize"):
        ModelRunner(quantized, num_slots=1, max_seq_len=16, quantized_kernel="int4")
