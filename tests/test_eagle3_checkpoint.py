"""The shipped EAGLE-3 head (models/minedraft-eagle3) is in the published checkpoint layout and fits the
bundled target it drafts for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

MODELS = Path(__file__).resolve().parents[1] / "models"
HEAD = MODELS / "minedraft-eagle3"
TARGET = MODELS / "minedraft-target"


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((HEAD / "config.json").read_text())


@pytest.fixture(scope="module")
def target_config() -> dict:
    return json.loads((TARGET / "config.json").read_text())


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    with safe_open(str(HEAD / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def test_config_is_the_llama_eagle3_layout(config: dict) -> None:
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["rms_norm_eps"] == 1e-6
    assert config["rope_theta"] == 10000.0
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert config["max_position_embeddings"] == 1024
    assert config["draft_vocab_size"] == config["vocab_size"] == 4096


def test_config_fits_the_bundled_target(config: dict, target_config: dict) -> None:
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"):
        assert config[key] == target_config[key], key
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    # Each id names the input of a decoder layer of the target, so it must be a layer the target has.
    assert all(0 < i < target_config["num_hidden_layers"] for i in config["eagle_aux_hidden_state_layer_ids"])


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, ffn, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    n_aux = len(config["eagle_aux_hidden_state_layer_ids"])
    return {
        "fc.weight": (hidden, n_aux * hidden),
        "midlayer.input_layernorm.weight": (hidden,),
        "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.self_attn.q_proj.weight": (q_out, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_out, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_out, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, q_out),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "midlayer.mlp.gate_proj.weight": (ffn, hidden),
        "midlayer.mlp.up_proj.weight": (ffn, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, ffn),
        "norm.weight": (hidden,),
        "lm_head.weight": (config["draft_vocab_size"], hidden),
    }


def test_every_tensor_has_its_published_name_and_shape(config: dict, tensors: dict[str, torch.Tensor]) -> None:
    shapes = expected_shapes(config)
    assert config["hidden_size"] == 256 and config["intermediate_size"] == 768
    # No embed_tokens.weight: the head reads the target's (tied) embedding.
    assert sorted(tensors) == sorted(shapes)
    for name, shape in shapes.items():
        assert tuple(tensors[name].shape) == shape, name


def test_weights_are_bf16_and_the_vocabulary_needs_no_map(config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The draft vocabulary is the target's, so the checkpoint has no d2t/t2d maps: vLLM refuses them then
    (it has no parameter to load them into), and the identity is what a missing map means."""
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.isfinite(tensor.float()).all(), name
    assert config["draft_vocab_size"] == config["vocab_size"] and "d2t" not in tensors and "t2d" not in tensors


def test_the_head_is_trained(tensors: dict[str, torch.Tensor]) -> None:
    """Trained weights, not a fresh initialisation: the midlayer's norms (initialised to 1) have moved."""
    for name in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight"):
        assert (tensors[name].float() - 1).abs().max() > 0.05, name


# ------------------------------------------------------------------ P-EAGLE (models/minedraft-eagle3-parallel)

PARALLEL = MODELS / "minedraft-eagle3-parallel"
PARD_DRAFT = MODELS / "minedraft-draft-pard"


@pytest.fixture(scope="module")
def parallel_config() -> dict:
    return json.loads((PARALLEL / "config.json").read_text())


@pytest.fixture(scope="module")
def parallel_tensors() -> dict[str, torch.Tensor]:
    with safe_open(str(PARALLEL / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def test_the_p_eagle_config_is_the_eagle3_heads_plus_its_mask_token(config: dict, parallel_config: dict) -> None:
    assert {k: v for k, v in parallel_config.items() if k != "mask_token_id"} == config
    mask_id = parallel_config["mask_token_id"]
    assert isinstance(mask_id, int) and 0 <= mask_id < parallel_config["vocab_size"]
    # The same never-emitted byte token the PARD draft masks with.
    assert mask_id == json.loads((PARD_DRAFT / "config.json").read_text())["pard_token"]


def test_the_p_eagle_tensors_are_the_eagle3_heads_plus_mask_hidden(
    parallel_config: dict, parallel_tensors: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]
) -> None:
    n_aux = len(parallel_config["eagle_aux_hidden_state_layer_ids"])
    shapes = {**expected_shapes(parallel_config), "mask_hidden": (1, n_aux * parallel_config["hidden_size"])}
    assert shapes["mask_hidden"] == (1, 768)
    assert sorted(parallel_tensors) == sorted(shapes)
    for name, shape in shapes.items():
        assert tuple(parallel_tensors[name].shape) == shape, name
        assert parallel_tensors[name].dtype == torch.bfloat16, name
        assert torch.isfinite(parallel_tensors[name].float()).all(), name
    assert "d2t" not in parallel_tensors and "t2d" not in parallel_tensors  # the identity, as the EAGLE-3 head's
    # A learned stand-in for the target's states, not zeros.
    assert parallel_tensors["mask_hidden"].float().abs().max() > 0
