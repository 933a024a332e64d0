"""Quantized checkpoints (block-scaled FP8, 4-bit AWQ) on tiny random models the tests write.

Each test quantizes a float checkpoint's linear layers itself, following the format's definition, and
writes beside it the same model with those weights dequantized by the test: loading the quantized folder
must give exactly the logits of the dequantized one. Unsupported methods and quantized tensors without a
quantization_config are refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_greedy_equivalence import STRICT, _run, _workload

from minedraft.config import EngineConfig
from minedraft.model.checkpoint import CheckpointError
from minedraft.model.runner import ModelRunner, SeqInput
from minedraft.scheduler.info import checkpoint_quantization

from tiny_models import make_tiny_checkpoint

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_BLOCK = (48, 40)  # does not divide the tiny model's 64 / 128 / 32: edge blocks are partial
AWQ_GROUP = 16
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the int32 nibble i holds output column AWQ_ORDER[i] of its eight


def _is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(".weight") and name.split(".")[-2] in LINEAR


def _save_variant(source: Path, folder: Path, tensors: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    shutil.copytree(source, folder)
    (folder / "model.safetensors").unlink()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def fp8_pair(source: Path, root: Path, block: tuple[int, int] = FP8_BLOCK) -> tuple[Path, Path]:
    """(fp8 checkpoint, the same weights dequantized in float32)."""
    quantized, dequantized = {}, {}
    for name, weight in load_file(source / "model.safetensors").items():
        if not _is_linear(name):
            quantized[name] = dequantized[name] = weight
            continue
        rows, cols = weight.shape
        b0, b1 = block
        scale = torch.empty(-(-rows // b0), -(-cols // b1))
        codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                tile = weight[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
                scale[i, j] = tile.abs().max() / 448.0  # e4m3's largest finite value
                codes[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
        quantized[name], quantized[f"{name}_scale_inv"] = codes, scale
        dequantized[name] = torch.stack([
            torch.stack([codes[r, c].float() * scale[r // b0, c // b1] for c in range(cols)]) for r in range(rows)
        ])  # fmt: skip
    config = {"quant_method": "fp8", "weight_block_size": list(block), "activation_scheme": "dynamic"}
    return (_save_variant(source, root / "fp8", quantized, config),
            _save_variant(source, root / "fp8-dequantized", dequantized, None))  # fmt: skip


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[n, 8 m] 4-bit values -> int32 [n, m], nibble i of each int32 holding column AWQ_ORDER[i] of its eight."""
    groups = values.reshape(values.shape[0], -1, 8).to(torch.int64)
    packed = torch.zeros(groups.shape[:2], dtype=torch.int64)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= groups[:, :, column] << (4 * nibble)
    return (packed - (packed >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # as int32 bit patterns


def awq_pair(source: Path, root: Path) -> tuple[Path, Path]:
    """(AWQ checkpoint, the same weights dequantized in float32)."""
    quantized, dequantized = {}, {}
    gen = torch.Generator().manual_seed(0)
    for name, weight in load_file(source / "model.safetensors").items():
        if not _is_linear(name):
            quantized[name] = dequantized[name] = weight
            continue
        w = weight.t()  # AWQ stores [in, out]
        groups = w.reshape(-1, AWQ_GROUP, w.shape[1])
        low, high = groups.amin(1), groups.amax(1)
        scales = ((high - low) / 15).clamp(min=1e-6).half()
        zeros = torch.randint(0, 16, scales.shape, generator=gen)  # any zero point in range must load exactly
        codes = (groups / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15).to(torch.int64)
        base = name[: -len(".weight")]
        quantized[f"{base}.qweight"] = _pack_awq(codes.reshape(w.shape))
        quantized[f"{base}.qzeros"] = _pack_awq(zeros)
        quantized[f"{base}.scales"] = scales
        dequantized[name] = ((codes - zeros[:, None]).float() * scales.float()[:, None]).reshape(w.shape).t()
        dequantized[name] = dequantized[name].contiguous()
    config = {"quant_method": "awq", "bits": 4, "group_size": AWQ_GROUP, "zero_point": True, "version": "gemm"}
    return (_save_variant(source, root / "awq", quantized, config),
            _save_variant(source, root / "awq-dequantized", dequantized, None))  # fmt: skip


def _logits(path: Path) -> torch.Tensor:
    runner = ModelRunner(path, num_slots=2, max_seq_len=64, batch_invariant=True)
    ids = torch.randint(0, runner.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    slot = runner.allocate_slot()
    return torch.cat([runner.forward([SeqInput(slot, ids[:20], 0, num_logits=20)]),
                      runner.forward([SeqInput(slot, ids[20:], 20, num_logits=10)])])  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_quantized_checkpoint_loads_exactly_its_dequantized_weights(tmp_path, method: str, arch: str) -> None:
    source = make_tiny_checkpoint(tmp_path / "float", arch, seed=4)
    quantized, reference = (fp8_pair if method == "fp8" else awq_pair)(source, tmp_path)
    ours = _logits(quantized)
    assert torch.equal(ours, _logits(reference))
    assert not torch.equal(ours, _logits(source)), "the quantization is meant to change the weights"
    assert ModelRunner(quantized, num_slots=1, max_seq_len=8).config.quantization.method == method
    # What GetServerInfo reports for it (the helper it calls, on the same folder).
    expected = {"fp8": "fp8 (blocks 48x40)", "awq": "awq (4-bit, group 16)"}[method]
    assert checkpoint_quantization(Path(quantized)) == expected and checkpoint_quantization(Path(source)) == ""


def test_quantized_target_and_draft_stay_lossless(tmp_path) -> None:
    target = fp8_pair(make_tiny_checkpoint(tmp_path / "t", "qwen3_moe", seed=5), tmp_path / "target")[0]
    draft = awq_pair(make_tiny_checkpoint(tmp_path / "d", "qwen3", num_layers=1, seed=5), tmp_path / "draft")[0]
    work = _workload(320, n=8, seed=2)
    base = {"model": str(target), "max_num_seqs": 3, "max_model_len": 96, **STRICT}
    spec = {"model": str(draft), "num_speculative_tokens": 3, "is_parallel": True}
    assert _run(EngineConfig(**base, speculative_config=spec), work, in_flight=2) == _run(EngineConfig(**base), work)


@pytest.mark.parametrize(("quantization", "message"), [
    ({"quant_method": "gptq", "bits": 4}, r"quantization method 'gptq' is not supported; supported: fp8"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, r"fp8 quantization without weight_block_size"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, r"awq with bits=8, .* is not supported"),
])  # fmt: skip
def test_unsupported_quantization_is_refused_by_name(tmp_path, quantization: dict, message: str) -> None:
    source = make_tiny_checkpoint(tmp_path / "float", "qwen3", seed=4)
    folder = _save_variant(source, tmp_path / "q", load_file(source / "model.safetensors"), quantization)
    with pytest.raises(CheckpointError, match=message):
        ModelRunner(folder, num_slots=1, max_seq_len=8)


def test_quantized_tensors_without_a_quantization_config_are_refused(tmp_path) -> None:
    source = make_tiny_checkpoint(tmp_path / "float", "qwen3", seed=4)
    fp8 = fp8_pair(source, tmp_path)[0]
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"is stored as F8_E4M3 without scales"):
        ModelRunner(fp8, num_slots=1, max_seq_len=8)
