"""MoE experts kept quantized, without a GPU: the grouped expert GEMMs (model/kernels/triton_moe.py) under Triton's
interpreter against the experts dequantized at load (the CPU path), from checkpoint tensors the tests
write: FP8 block-scaled and AWQ experts, a tensor-parallel rank's slice, uneven token counts per expert
with experts that get none; and the model runner on a tiny quantized Qwen3-MoE checkpoint, experts kept
as stored, against the runner that dequantizes it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("triton")

from test_quantization import _pack_awq, awq_pair, fp8_pair  # noqa: E402
from test_quantized_kernels import _logits  # noqa: E402

from minedraft.model.checkpoint import CheckpointReader  # noqa: E402
from minedraft.model.kernels.triton_moe import route  # noqa: E402
from minedraft.model.kernels.triton_quant import pick_tiles  # noqa: E402
from minedraft.model.layers import quantized_linears  # noqa: E402
from minedraft.model.loader import weight_bytes  # noqa: E402
from minedraft.model.moe import StackedExperts  # noqa: E402
from minedraft.model.parallel import TensorParallel  # noqa: E402
from minedraft.model.quantization import QuantConfig  # noqa: E402
from minedraft.model.runner import ModelRunner  # noqa: E402

from tiny_models import make_tiny_checkpoint  # noqa: E402

EXPERTS, HIDDEN, INTERMEDIATE = 5, 64, 64  # two ranks: 32 intermediate rows / columns each
QUANT = {"fp8": QuantConfig("fp8", block=(16, 16)), "awq": QuantConfig("awq", group_size=16)}
# 21 tokens, top 2: expert 0 has 18 pairs (two tiles of 16 rows), 1, 2 and 4 a few, expert 3 none.
ROUTED = torch.tensor([[0, 1], [2, 0], [0, 4]] * 6 + [[1, 2], [4, 1], [2, 4]])


def _write_experts(folder: Path, method: str, gen: torch.Generator) -> Path:
    """Every expert's gate/up/down in `method`'s checkpoint layout (model.safetensors), random codes."""
    tensors: dict[str, torch.Tensor] = {}
    for e in range(EXPERTS):
        for part, (out, inp) in (("gate_proj", (INTERMEDIATE, HIDDEN)), ("up_proj", (INTERMEDIATE, HIDDEN)),
                                 ("down_proj", (HIDDEN, INTERMEDIATE))):  # fmt: skip
            name = f"mlp.experts.{e}.{part}"
            if method == "fp8":
                tensors[f"{name}.weight"] = (torch.randn(out, inp, generator=gen) * 40).to(torch.float8_e4m3fn)
                tensors[f"{name}.weight_scale_inv"] = torch.rand(out // 16, inp // 16, generator=gen) * 2e-3 + 1e-3
            else:
                tensors[f"{name}.qweight"] = _pack_awq(torch.randint(0, 16, (inp, out), generator=gen))
                tensors[f"{name}.qzeros"] = _pack_awq(torch.randint(0, 16, (inp // 16, out), generator=gen))
                tensors[f"{name}.scales"] = (torch.rand(inp // 16, out, generator=gen) * 0.01).half()
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    return folder


def _experts(folder: Path, quant: QuantConfig, keep: bool, dtype: torch.dtype, batch_invariant: bool = False,
             rank: int = 1) -> StackedExperts:
    """Rank `rank` of two's StackedExperts, loaded from the folder: kept as stored (`keep`, as on CUDA) or
    dequantized at load (the CPU path)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with quantized_linears(quant if keep else None):
            experts = StackedExperts(EXPERTS, HIDDEN, INTERMEDIATE, TensorParallel(rank=rank, size=2), batch_invariant)
    finally:
        torch.set_default_dtype(previous)
    reader = CheckpointReader(folder, quant)
    for param in (experts.w13, experts.w2):
        for part, shard in param.checkpoint_parts:
            param.weight_loader(param, reader.tensor(f"mlp.experts.{part}"), shard)
    return experts


def _inputs(dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(len(ROUTED), HIDDEN, generator=gen).to(dtype)
    weights = torch.softmax(torch.randn(len(ROUTED), 2, generator=gen), -1).to(dtype)
    return x, weights


@pytest.mark.parametrize(("method", "dtype"), [("fp8", torch.float32), ("fp8", torch.bfloat16),
                                               ("awq", torch.float32), ("awq", torch.bfloat16)])  # fmt: skip
def test_grouped_experts_match_the_experts_dequantized_at_load(tmp_path, method: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    folder = _write_experts(tmp_path / method, method, gen)
    kept = _experts(folder, QUANT[method], keep=True, dtype=dtype)
    dense = _experts(folder, QUANT[method], keep=False, dtype=dtype)
    assert set(kept.quantized) == {"w13", "w2"} and kept.w13.numel() == kept.w2.numel() == 0 and not kept.fallbacks
    stored = kept.quantized["w13"].parts["weight" if method == "fp8" else "qweight"]
    assert stored.dtype == (torch.float8_e4m3fn if method == "fp8" else torch.int32) and stored.shape[0] == EXPERTS
    x, weights = _inputs(dtype, gen)
    got, expected = kept(x, ROUTED, weights), dense(x, ROUTED, weights)
    largest = expected.abs().max().item()
    # Two GEMMs in another summation order, and the interpreter (Triton 3.9) rounds to bf16 by truncation:
    # four units in the last place of the output's dtype at the largest value.
    tolerance = (4 * torch.finfo(dtype).eps + 1e-5) * largest
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=0)
    # A token's experts only: expert 3 (no tokens) is never read, expert 0's 18 pairs span two tiles.
    assert (torch.bincount(ROUTED.flatten(), minlength=EXPERTS) == torch.tensor([18, 8, 8, 0, 8])).all()


def test_unquantized_experts_run_in_the_same_launches(tmp_path) -> None:
    """A stack that falls back to dense weights runs the same grouped launches, as dense tiles."""
    gen = torch.Generator().manual_seed(1)
    folder = _write_experts(tmp_path / "fp8", "fp8", gen)
    dense = _experts(folder, QUANT["fp8"], keep=False, dtype=torch.float32)
    grouped = _experts(folder, QUANT["fp8"], keep=False, dtype=torch.float32)
    grouped.grouped = True  # what a model built on CUDA runs for experts held densely
    x, weights = _inputs(torch.float32, gen)
    expected = dense(x, ROUTED, weights)
    torch.testing.assert_close(grouped(x, ROUTED, weights), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


def test_a_tokens_result_does_not_depend_on_the_batch_with_batch_invariant(tmp_path) -> None:
    """Strict mode: fixed tiles, K never split, each token's slots added in a fixed order, so a token's
    output is bit for bit the same alone and in any batch."""
    gen = torch.Generator().manual_seed(2)
    kept = _experts(_write_experts(tmp_path / "fp8", "fp8", gen), QUANT["fp8"], keep=True, dtype=torch.bfloat16,
                    batch_invariant=True)  # fmt: skip
    x, weights = _inputs(torch.bfloat16, gen)
    batch = kept(x, ROUTED, weights)
    for token in (0, 7, 20):
        alone = kept(x[token : token + 1], ROUTED[token : token + 1], weights[token : token + 1])
        assert torch.equal(alone[0], batch[token])
    cuda = torch.device("cuda")  # the tiles a GPU would get, without asking one for its SM count
    strict = {pick_tiles(m, 4096, 14336, 128, cuda, batch_invariant=True) for m in (1, 17, 500)}
    assert len(strict) == 1 and next(iter(strict)).split_k == 1


def test_routing_pads_each_expert_to_whole_tiles_without_a_host_sync() -> None:
    routing = route(ROUTED, EXPERTS, block_m=16)
    tiles = routing.sorted_pairs.view(-1, 16)
    assert routing.tile_experts.tolist() == [0, 0, 1, 2, 4, -1, -1, -1]  # sized for ceil(42 / 16) + 5 tiles
    pairs = ROUTED.flatten()
    for tile, expert in enumerate(routing.tile_experts.tolist()):
        real = tiles[tile][tiles[tile] < pairs.numel()]
        assert (pairs[real.long()] == expert).all() and (expert >= 0 or real.numel() == 0)
    assert sorted(tiles[tiles < pairs.numel()].tolist()) == list(range(pairs.numel())), "every pair exactly once"


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE (layer 0: 4 experts of intermediate size 32, top 2) that the runner tests quantize."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "float", "qwen3_moe", seed=4)


def _expert_stacks(runner: ModelRunner) -> list[StackedExperts]:
    return [m for m in runner.model.modules() if isinstance(m, StackedExperts)]


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_the_runner_keeps_quantized_experts_and_gives_the_same_logits(tmp_path, moe_source: Path, method: str) -> None:
    pair = fp8_pair(moe_source, tmp_path, block=(16, 16)) if method == "fp8" else awq_pair(moe_source, tmp_path)
    quantized = pair[0]
    kept, runner = _logits(quantized, "triton")
    dense, dequantized = _logits(quantized, "dequantize")
    torch.testing.assert_close(kept, dense, atol=1e-4, rtol=1e-4)
    stacks = _expert_stacks(runner)
    assert stacks and all(set(s.quantized) == {"w13", "w2"} and s.w13.numel() == 0 for s in stacks)
    # What the KV budget sees on a GPU: the weights at their stored size. Every linear layer and expert is
    # kept quantized here, so the two runners differ by exactly the checkpoint's quantized tensors' expansion.
    tensors = load_file(quantized / "model.safetensors")
    if method == "fp8":
        codes = [t for name, t in tensors.items() if name.endswith(".weight") and t.dtype == torch.float8_e4m3fn]
        scales = [t for name, t in tensors.items() if name.endswith("_scale_inv")]
        saved = sum(4 * c.numel() - c.numel() for c in codes) - sum(4 * s.numel() for s in scales)
    else:
        packed = [t for name, t in tensors.items() if name.endswith((".qweight", ".qzeros"))]
        scales = [t for name, t in tensors.items() if name.endswith(".scales")]
        weights = sum(t.numel() * 8 for name, t in tensors.items() if name.endswith(".qweight"))
        saved = 4 * weights - sum(4 * t.numel() for t in packed) - sum(4 * s.numel() for s in scales)  # scales: fp32
    assert weight_bytes(dequantized.model)[0] - weight_bytes(runner.model)[0] == saved
    assert weight_bytes(dequantized.model)[1] == 0 and weight_bytes(runner.model)[1] > 0


def test_experts_whose_blocks_do_not_line_up_are_dequantized_and_say_so(tmp_path, moe_source: Path, caplog) -> None:
    """48 x 40 blocks: the gate/up stack (up at row 32) cannot be stored as blocks and is dequantized, with
    a warning; the down stack (32 columns, one partial block) stays FP8; the logits stay exact."""
    quantized = fp8_pair(moe_source, tmp_path)[0]
    with caplog.at_level(logging.WARNING, logger="minedraft.model.runner"):
        kept, runner = _logits(quantized, "triton")
    torch.testing.assert_close(kept, _logits(quantized, "dequantize")[0], atol=1e-4, rtol=1e-4)
    stacks = _expert_stacks(runner)
    assert all(set(s.quantized) == {"w2"} and s.w13.shape == (4, 64, 64) for s in stacks)
    assert "MoE experts' w13: rank 0's slice (32 rows from 0) or the checkpoint's tensors do not line up with fp8 " \
           "(blocks 48x40) storage: dequantized at load (MoE layers: 1)" in caplog.text  # fmt: skip


_COMPILE_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minedraft.model.kernels import triton_moe

rows = {"Y": "*bf16", "SortedPairs": "*i32", "TileExperts": "*i32", "num_pairs": "i32", "x_div": "i32", "N": "i32",
        "K": "i32", "stride_xm": "i32", "stride_ym": "i32"}
tiles = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "UPCAST": False}
kernels = {
    "fp8": (triton_moe._grouped_fp8_kernel, {"X": "*bf16", "Codes": "*u8", "Scales": "*fp32", **{
        s: "i32" for s in ("stride_ce", "stride_cn", "stride_se", "stride_sn")}, **rows}, {"B0": 128, "B1": 128}),
    "awq": (triton_moe._grouped_awq_kernel, {"X": "*bf16", "QWeight": "*i32", "QZeros": "*i32", "Scales": "*bf16", **{
        s: "i32" for s in ("stride_qe", "stride_ze", "stride_se", "stride_qk", "stride_zk", "stride_sk")}, **rows},
        {"GROUP": 128, "BLOCK_N": 128, "BLOCK_K": 64}),
    "dense": (triton_moe._grouped_dense_kernel, {"X": "*bf16", "W": "*bf16", "stride_we": "i32", "stride_wn": "i32",
                                                **rows}, {"BLOCK_K": 64}),
}
for name, (kernel, signature, constants) in kernels.items():
    constexprs = {**tiles, **constants}
    source = ASTSource(kernel, {**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    print(name, "cubin" in compiled.asm)
"""


def test_the_grouped_kernels_compile_for_an_h100(tmp_path) -> None:
    """The interpreter runs Python, not Triton's compiler: compile each grouped kernel for sm_90 (an H100),
    down to its cubin, which needs no GPU. Its own process, as the interpreter is on in this one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[1] / "services"))
    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_H100], env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["fp8", "True", "awq", "True", "dense", "True"]
