"""Checkpoint, config and tokenizer loading: happy paths and clear errors for bad inputs."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from minedraft.model.checkpoint import CheckpointError, CheckpointNotFoundError
from minedraft.model.config import load_model_config, parse_model_config
from minedraft.model.layers import QKVParallelLinear
from minedraft.model.parallel import TensorParallel
from minedraft.model.runner import ModelRunner, SeqInput
from minedraft.model.tokenizer import load_tokenizer

from tiny_models import BOS_ID, EOS_ID, make_tiny_checkpoint, torch_threads


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    return {
        "llama": make_tiny_checkpoint(root / "llama", "llama", num_layers=1),
        "qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3", num_layers=1),
        "sharded": make_tiny_checkpoint(root / "sharded", "qwen2", num_layers=1, max_shard_size="20KB"),
    }


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A private copy of a checkpoint that a test may break."""

    def copy(name: str = "qwen3"):
        return shutil.copytree(pristine[name], tmp_path / name)

    return copy


def load(path):
    return ModelRunner(path, num_slots=1, max_seq_len=16)


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


# Config and tokenizer ------------------------------------------------------------------------------


def test_config_fields(pristine):
    llama, qwen3 = load_model_config(pristine["llama"]), load_model_config(pristine["qwen3"])
    assert (llama.architecture, llama.qkv_bias, llama.qk_norm, llama.tie_word_embeddings) == (
        "LlamaForCausalLM", False, False, False)
    assert (qwen3.architecture, qwen3.qk_norm, qwen3.tie_word_embeddings) == ("Qwen3ForCausalLM", True, True)
    assert qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_attention_heads
    assert (qwen3.vocab_size, qwen3.num_layers, qwen3.num_kv_heads) == (320, 1, 2)
    assert qwen3.eos_token_ids == [EOS_ID]
    assert load_model_config(pristine["sharded"]).qkv_bias  # Qwen2 always has a qkv bias


def test_eos_ids_prefer_generation_config():
    raw = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "eos_token_id": 7}
    assert parse_model_config(raw).eos_token_ids == [7]
    assert parse_model_config(raw, {"eos_token_id": [3, 4]}).eos_token_ids == [3, 4]
    assert parse_model_config(raw, {"eos_token_id": 5}).eos_token_ids == [5]


def test_pard_mask_token_is_read_under_both_names():
    raw = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2}
    assert parse_model_config(raw).pard_token is None
    assert parse_model_config({**raw, "pard_token": 9}).pard_token == 9
    assert parse_model_config({**raw, "ptd_token_id": 3}).pard_token == 3
    for bad in (10, -1, "9", True):
        with pytest.raises(CheckpointError, match=f"pard_token must be a token id below vocab_size, got {bad!r}"):
            parse_model_config({**raw, "pard_token": bad})


def test_legacy_rope_keys_are_understood():
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
           "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
    rope = parse_model_config(raw).rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("llama3", 500000.0, 8.0)
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(CheckpointError, match="rope type 'yarn' is not supported; supported: default, linear, llama3"):
        parse_model_config(raw)


def test_tokenizer_round_trip_and_bos(pristine):
    llama, qwen = load_tokenizer(pristine["llama"]), load_tokenizer(pristine["qwen3"])
    ids = llama.encode("Hello, wörld!")
    assert ids[0] == BOS_ID and qwen.encode("Hello, wörld!") == ids[1:]
    assert llama.decode(ids) == "Hello, wörld!"
    assert llama.decode(ids, skip_special_tokens=False).startswith("<s>")
    assert llama.vocab_size == 320 and llama.id_to_token(EOS_ID) == "</s>"


def test_tokenizer_needs_no_torch(pristine):
    code = (f"import sys; from minedraft.model.tokenizer import load_tokenizer; "
            f"load_tokenizer({str(pristine['qwen3'])!r}).encode('hi'); assert 'torch' not in sys.modules")
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)


# Clear errors --------------------------------------------------------------------------------------


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="checkpoint folder not found: .*nowhere"):
        load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError):  # also a FileNotFoundError for callers that expect one
        load(tmp_path / "nowhere")


def test_missing_config(ckpt):
    path = ckpt()
    (path / "config.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match="config.json not found"):
        load(path)


def test_invalid_config_json(ckpt):
    path = ckpt()
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load(path)


def test_unsupported_architecture(ckpt):
    path = ckpt()
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="unsupported architecture GPT2LMHeadModel; supported: "
                                              "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load(path)


def test_missing_weights(ckpt):
    path = ckpt()
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match="no weights in .*model.safetensors.index.json, pytorch_model"):
        load(path)
    (path / "model.pt").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="found model.pt; of pickled weights only pytorch_model.bin is read"):
        load(path)
    (path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="corrupt, unreadable or unsafe pickled weights .*pytorch_model.bin"):
        load(path)


class _RunsCode:
    """Unpickling this calls a function: what a hostile checkpoint would do."""

    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_pytorch_model_bin_gives_the_safetensors_logits_and_refuses_code(ckpt, capsys):
    """pytorch_model.bin (as published EAGLE heads ship) is read with torch's restricted unpickler: the same
    tensors as safetensors give, and a pickle that would call a function is refused without running it."""
    path = ckpt("llama")
    tokens = [5, 9, 2, 7]
    reference = load(path)
    expected = reference.forward([SeqInput(reference.allocate_slot(), tokens, 0, num_logits=4)])
    torch.save(load_file(str(path / "model.safetensors")), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    runner = load(path)
    torch.testing.assert_close(runner.forward([SeqInput(runner.allocate_slot(), tokens, 0, num_logits=4)]), expected,
                               atol=0, rtol=0)  # fmt: skip
    torch.save({"model.norm.weight": _RunsCode()}, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="unsafe pickled weights"):
        load(path)
    assert "unpickled code ran" not in capsys.readouterr().out


def test_missing_shard(ckpt):
    path = ckpt("sharded")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointNotFoundError, match=f"safetensors file not found: .*{shard.name}"):
        load(path)


def test_corrupt_safetensors(ckpt):
    path = ckpt()
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointError, match="corrupt or unreadable safetensors file .*model.safetensors"):
        load(path)


def test_truncated_safetensors(ckpt):
    path = ckpt()
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load(path)


def test_missing_tensor(ckpt):
    path = ckpt()
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="tensor model.layers.0.mlp.up_proj.weight is missing"):
        load(path)


def test_untied_checkpoint_without_lm_head(ckpt):
    path = ckpt()
    edit_config(path, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="tensor lm_head.weight is missing"):
        load(path)


def test_shape_mismatch(ckpt):
    path = ckpt()
    edit_config(path, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"shape mismatch for tensor model.layers.0.mlp.gate_proj.weight "
                                              r"in model.safetensors: checkpoint has \[128, 64\], the model "
                                              r"expects \[96, 64\]"):
        load(path)


def test_missing_tokenizer(ckpt):
    path = ckpt()
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match="tokenizer.json not found"):
        load(path)


def test_heads_must_split_over_tensor_parallel_ranks():
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor-parallel size 3"):
        QKVParallelLinear(64, 16, 4, 2, False, TensorParallel(rank=0, size=3), True)
    with pytest.raises(ValueError, match="num_key_value_heads=3 must be a multiple or a divisor"):
        QKVParallelLinear(64, 16, 6, 3, False, TensorParallel(rank=0, size=2), True)
    qkv = QKVParallelLinear(64, 16, 8, 2, False, TensorParallel(rank=3, size=4), True)  # kv heads replicated
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.kv_head_start) == (2, 1, 1)
    assert qkv.weight.shape == ((2 + 2) * 16, 64)


def test_bf16_runner_dtype_strings(pristine):
    r = ModelRunner(pristine["qwen3"], num_slots=1, max_seq_len=8, dtype="bf16")
    assert r.model.lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        ModelRunner(pristine["qwen3"], num_slots=1, max_seq_len=8, dtype="int8")
