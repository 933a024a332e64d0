"""GGUF checkpoints written by the `gguf` library from tiny random Hugging Face checkpoints: the engine's
logits from the file equal transformers' (from the folder, and from the same file where transformers reads
it), for each architecture and for quantized tensors; a tensor-parallel shard is the full tensor's rows or
columns; and what the loader cannot honour is refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch

from minedraft.model.checkpoint import resolve_checkpoint
from minedraft.model.config import load_model_config
from minedraft.model.errors import CheckpointError
from minedraft.model.gguf import GGUFTensor, _dequantized_in_torch
from minedraft.model.runner import ModelRunner, SeqInput
from minedraft.model.tokenizer import load_tokenizer

from tiny_models import TEMPLATE, load_hf_model, make_tiny_checkpoint, write_gguf

PROMPT = [5, 17, 42, 99, 3, 250, 7, 7, 31]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    # head_dim = hidden / heads: transformers' own GGUF reader derives it so for Qwen3 as well
    return {arch: make_tiny_checkpoint(root / arch, arch, num_layers=2, seed=3, head_dim=16)
            for arch in ("llama", "qwen2", "qwen3")}  # fmt: skip


def ours(path, tp_group=None) -> torch.Tensor:
    runner = ModelRunner(path, max_seq_len=64, num_slots=1, device="cpu")
    return runner.forward([SeqInput(runner.allocate_slot(), PROMPT, 0, num_logits=len(PROMPT))])


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_float_gguf_matches_the_hf_folder(checkpoints, arch, tmp_path) -> None:
    gguf = write_gguf(checkpoints[arch], tmp_path / "model.gguf")
    assert load_model_config(gguf).architecture == load_model_config(checkpoints[arch]).architecture
    torch.testing.assert_close(ours(gguf), reference(load_hf_model(checkpoints[arch])), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1", "Q5_K"])
def test_quantized_gguf_matches_transformers_reading_it(checkpoints, arch, quant, tmp_path) -> None:
    """Dequantized by the gguf library on both sides: equal to float32 noise (the K-quant: 256-wide blocks,
    so its rows are 256 wide here)."""
    from transformers import AutoModelForCausalLM

    folder = checkpoints[arch]
    if quant == "Q5_K":
        folder = make_tiny_checkpoint(tmp_path / "wide", arch, hidden_size=256, intermediate_size=256,
                                      num_layers=1, num_heads=4, num_kv_heads=2, seed=4)  # fmt: skip
    gguf = write_gguf(folder, tmp_path / "model.gguf", quant)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.float32).eval()
    torch.testing.assert_close(ours(gguf), reference(hf), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
def test_types_dequantized_in_torch_equal_the_gguf_library_bit_for_bit(checkpoints, quant, tmp_path) -> None:
    """Q8_0 and Q4_1 are dequantized by torch ops, not by the library: every tensor, every bit, as the library
    gives it (scales across the float16 range, every nibble and int8 value)."""
    import numpy as np
    from gguf.quants import dequantize

    from minedraft.model.gguf import open_gguf

    file = open_gguf(write_gguf(checkpoints["llama"], tmp_path / "model.gguf", quant))
    quantized = [t for t in file.reader.tensors if t.tensor_type.name == quant]
    assert quantized
    for tensor in quantized:
        theirs = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        assert torch.equal(GGUFTensor(file, tensor.name, tensor.name, None).read(), theirs), tensor.name
    rng = np.random.default_rng(0)  # blocks of random bytes: any scale, minimum and quant the format can hold
    size, halves = {"Q8_0": (34, 1), "Q4_1": (20, 2)}[quant]  # block bytes, float16s leading a block
    blocks = rng.integers(0, 256, (64, 8 * size), dtype=np.uint8)
    scales = rng.uniform(-60000, 60000, (64, 8, halves)).astype(np.float16).view(np.uint8)  # finite
    blocks.reshape(64, 8, size)[:, :, : 2 * halves] = scales
    theirs = torch.from_numpy(dequantize(blocks, tensor.tensor_type).astype(np.float32))
    assert torch.equal(_dequantized_in_torch(blocks, quant), theirs)


@pytest.mark.parametrize("quant", ["Q4_K", "Q4_1"])
def test_shards_read_only_their_rows_and_columns(checkpoints, quant, tmp_path) -> None:
    """What a tensor-parallel rank reads (a range of rows, or of columns) equals that range of the whole
    tensor, Llama's permuted Q/K rows included."""
    from minedraft.model.checkpoint import open_reader

    folder = make_tiny_checkpoint(tmp_path / "wide", "llama", hidden_size=256, intermediate_size=512,
                                  num_layers=1, num_heads=4, num_kv_heads=2, seed=5)  # fmt: skip
    reader = open_reader(write_gguf(folder, tmp_path / "model.gguf", quant))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"):  # fmt: skip
        tensor = reader.tensor(name)
        whole = tensor.read()
        rows, cols = tensor.shape
        assert torch.equal(tensor.read(0, rows // 2, rows // 2), whole[rows // 2:])
        assert torch.equal(tensor.read(1, cols // 2, cols // 2), whole[:, cols // 2:])
        assert torch.equal(tensor.read(1, 3, 100), whole[:, 3:103])  # not on a block boundary


def test_tokenizer_and_template_come_from_the_metadata(checkpoints, tmp_path) -> None:
    from minedraft.frontends.chat import ChatTemplate

    gguf = write_gguf(checkpoints["llama"], tmp_path / "model.gguf")
    ours_tok, theirs = load_tokenizer(gguf), load_tokenizer(checkpoints["llama"])
    for text in ["hello world", "  two  spaces\nand a line", "<s>special</s> ünï 123"]:
        assert ours_tok.encode(text) == theirs.encode(text)  # the BOS llama's metadata asks for included
        assert ours_tok.decode(ours_tok.encode(text)) == theirs.decode(theirs.encode(text))
    template = ChatTemplate.from_checkpoint(gguf)
    assert template is not None and template.source == TEMPLATE
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>user: hi\n"


def test_a_folder_with_one_gguf_and_files_beside_it(checkpoints, tmp_path) -> None:
    """A folder holding one .gguf names it; a tokenizer.json beside the file wins over the metadata."""
    folder = tmp_path / "model"
    folder.mkdir()
    gguf = write_gguf(checkpoints["qwen2"], folder / "m.gguf")
    assert resolve_checkpoint(folder) == gguf
    shutil.copy(checkpoints["llama"] / "tokenizer.json", folder / "tokenizer.json")  # adds a BOS: tells them apart
    assert load_tokenizer(folder).encode("hi")[0] == 1
    write_gguf(checkpoints["qwen2"], folder / "other.gguf")
    with pytest.raises(CheckpointError, match="several GGUF files"):
        resolve_checkpoint(folder)


def test_refusals_name_what_is_wrong(checkpoints, tmp_path) -> None:
    llama = checkpoints["llama"]
    with pytest.raises(CheckpointError, match="architecture 'gpt2' is not supported"):
        load_model_config(write_gguf(llama, tmp_path / "arch.gguf", arch="gpt2"))
    bad_type = write_gguf(llama, tmp_path / "int.gguf", tensor_types={"blk.0.ffn_up.weight": "I8"})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight is stored as I8"):
        ours(bad_type)
    whole = write_gguf(llama, tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) - 1000])
    with pytest.raises(CheckpointError, match="truncated GGUF file .*cut.gguf"):
        load_model_config(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(whole[:300])
    with pytest.raises(CheckpointError, match="head.gguf"):
        load_model_config(tmp_path / "head.gguf")
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_model_config(tmp_path / "fake.gguf")


def test_auto_on_cpu_holds_a_gguf_as_bfloat16_values(checkpoints, tmp_path) -> None:
    """A GGUF file declares bfloat16: on CPU 'auto' keeps float32 arithmetic on its weights rounded to bfloat16
    values (which the one-call stack then streams as bfloat16), float32 keeps them as the file gives them, and a
    float32 folder stays as stored under auto."""
    gguf = write_gguf(checkpoints["llama"], tmp_path / "model.gguf", "Q8_0")
    auto, exact = (ModelRunner(gguf, max_seq_len=64, num_slots=1, dtype=dtype) for dtype in ("auto", "float32"))
    assert auto.weights_bf16 and not exact.weights_bf16
    changed = 0
    for rounded, stored in zip(auto.model.parameters(), exact.model.parameters(), strict=True):
        assert rounded.dtype == torch.float32 and torch.equal(rounded, stored.to(torch.bfloat16).float())
        changed += not torch.equal(rounded, stored)
    assert changed > 0
    assert auto.model.model.decode_stack.bf16 and not exact.model.model.decode_stack.bf16
    assert not ModelRunner(checkpoints["llama"], max_seq_len=64, num_slots=1, dtype="auto").weights_bf16


def test_a_gguf_saved_as_a_folder_serves_the_same_weights(checkpoints, tmp_path) -> None:
    """`save_hf_folder` (what vLLM and llama.cpp's converter are given in benchmarks): bfloat16 safetensors of
    exactly the values auto holds, which transformers reads too."""
    from minedraft.model.gguf import save_hf_folder

    gguf = write_gguf(checkpoints["llama"], tmp_path / "model.gguf", "Q4_1")
    folder = save_hf_folder(gguf, tmp_path / "hf")
    assert save_hf_folder(gguf, folder) == folder  # reused
    runners = [ModelRunner(path, max_seq_len=64, num_slots=1, dtype="auto") for path in (gguf, folder)]
    for ours_, theirs in zip(runners[0].model.parameters(), runners[1].model.parameters(), strict=True):
        assert torch.equal(ours_, theirs)
    logits = [r.forward([SeqInput(r.allocate_slot(), PROMPT, 0, num_logits=len(PROMPT))]) for r in runners]
    assert torch.equal(*logits)
    torch.testing.assert_close(logits[1], reference(load_hf_model(folder)), atol=1e-4, rtol=1e-4)
    assert load_tokenizer(folder).encode("hello world") == load_tokenizer(gguf).encode("hello world")
