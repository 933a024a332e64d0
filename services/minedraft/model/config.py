"""ModelConfig: the few Hugging Face config.json fields the runner needs, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minedraft.model.checkpoint import CheckpointError, read_json, resolve_checkpoint
from minedraft.model.gguf import is_gguf, open_gguf
from minedraft.model.quantization import QuantConfig, parse_quant_config

EAGLE3 = "LlamaForCausalLMEagle3"  # an EAGLE-3 draft head (model/eagle.py); `speculators` calls it Eagle3Speculator
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", EAGLE3)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    qkv_bias: bool  # Qwen2 always, Llama/Qwen3 when attention_bias
    o_proj_bias: bool  # Llama/Qwen3 attention_bias; never Qwen2
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rotary
    tie_word_embeddings: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    pard_token: int | None = None  # the mask token of a draft trained for parallel drafting (PARD, P-EAGLE)
    quantization: QuantConfig | None = None  # how the checkpoint's weights are stored (None: plain floats)
    # Mixture of experts (Qwen3-MoE): the layers whose MLP routes each token to its top experts.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # EAGLE-3 heads: the draft vocabulary's size, and the target layers whose input the head reads (None:
    # eagle.default_aux_layers of the target).
    draft_vocab_size: int = 0
    aux_hidden_layers: tuple[int, ...] | None = None
    # EAGLE-1 heads of the HASS variant: RMSNorm on the embedding and on the hidden input before fc.
    add_para_norm: bool = False

    @property
    def is_eagle3(self) -> bool:
        return self.architecture == EAGLE3

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def num_heads(self) -> int:
        return self.num_attention_heads


def load_model_config(path: str | Path) -> ModelConfig:
    """Parse <path>/config.json (and generation_config.json for EOS ids), or a GGUF file's metadata."""
    folder = resolve_checkpoint(path)
    if is_gguf(folder):
        return parse_model_config(open_gguf(folder).hf_config(), source=folder)
    raw = read_json(folder / "config.json", required=True)
    generation = read_json(folder / "generation_config.json", required=False)
    return parse_model_config(raw, generation, source=folder / "config.json")


def parse_model_config(
    raw: dict[str, Any], generation: dict[str, Any] | None = None, *, source: str | Path = "config.json"
) -> ModelConfig:
    raw = _speculators_flattened(raw)
    arch = _architecture(raw, source)
    hidden, heads = _require_int(raw, "hidden_size", source), _require_int(raw, "num_attention_heads", source)
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    _check_unsupported_features(raw, source)
    attention_bias = bool(raw.get("attention_bias", False))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    layers = 1 if arch == EAGLE3 else _require_int(raw, "num_hidden_layers", source)
    return ModelConfig(
        architecture=arch,
        model_type=str(raw.get("model_type", "")),
        vocab_size=_require_int(raw, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_require_int(raw, "intermediate_size", source),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_config(raw, source),
        qkv_bias=is_qwen2 or attention_bias,
        o_proj_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),  # an EAGLE-3 head has none
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(generation, raw),
        bos_token_id=raw.get("bos_token_id"),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        pard_token=_pard_token(raw, source),
        quantization=parse_quant_config(raw, source),
        add_para_norm=bool(raw.get("add_para_norm", False)),
        **(_moe_fields(raw, layers, source) if arch == "Qwen3MoeForCausalLM" else {}),
        **(_eagle3_fields(raw, source) if arch == EAGLE3 else {}),
    )


def _speculators_flattened(raw: dict[str, Any]) -> dict[str, Any]:
    """A `speculators` EAGLE-3 config nests the layer's fields in transformer_layer_config: lift them."""
    if raw.get("speculators_model_type") != "eagle3" and "Eagle3Speculator" not in (raw.get("architectures") or []):
        return raw
    layer = dict(raw.get("transformer_layer_config") or {})
    return {**layer, **{k: v for k, v in raw.items() if k != "transformer_layer_config"}, "architectures": [EAGLE3]}


def _eagle3_fields(raw: dict[str, Any], source: str | Path) -> dict[str, Any]:
    vocab = _require_int(raw, "vocab_size", source)
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        raise CheckpointError(f"{source}: draft_vocab_size={draft_vocab} must be in [1, vocab_size={vocab}]")
    layers = raw.get("eagle_aux_hidden_state_layer_ids")
    if layers is not None and (not isinstance(layers, list) or len(layers) != 3
                               or not all(isinstance(i, int) and i >= 0 for i in layers)):  # fmt: skip
        raise CheckpointError(f"{source}: eagle_aux_hidden_state_layer_ids must list three layer ids, got {layers!r}")
    return {"draft_vocab_size": draft_vocab, "aux_hidden_layers": tuple(layers) if layers is not None else None}


def _moe_fields(raw: dict[str, Any], layers: int, source: str | Path) -> dict[str, Any]:
    """Qwen3-MoE: experts in every `decoder_sparse_step`-th layer except `mlp_only_layers`."""
    raw = {**raw, "num_experts": raw.get("num_experts", raw.get("num_local_experts"))}
    experts, top_k = _require_int(raw, "num_experts", source), _require_int(raw, "num_experts_per_tok", source)
    if top_k > experts:
        raise CheckpointError(f"{source}: num_experts_per_tok={top_k} exceeds num_experts={experts}")
    step, dense = int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers") or [])
    if step < 1:
        raise CheckpointError(f"{source}: decoder_sparse_step must be >= 1, got {step}")
    return {
        "moe_layers": tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": _require_int(raw, "moe_intermediate_size", source),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
    }


def _architecture(raw: dict[str, Any], source: str | Path) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    found = ", ".join(archs) if archs else f"none (model_type={raw.get('model_type')!r})"
    raise CheckpointError(
        f"{source}: unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _require_int(raw: dict[str, Any], key: str, source: str | Path) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _check_unsupported_features(raw: dict[str, Any], source: str | Path) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    layer_types = raw.get("layer_types") or []
    if raw.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise CheckpointError(f"{source}: sliding-window attention is not supported")
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{source}: partial_rotary_factor != 1 is not supported")


def _rope_config(raw: dict[str, Any], source: str | Path) -> RopeConfig:
    # transformers >= 5 writes rope_parameters (theta inside); older configs use rope_theta + rope_scaling.
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    missing = [k for k in _LLAMA3_KEYS if k not in params]
    if missing:
        raise CheckpointError(f"{source}: llama3 rope scaling lacks {', '.join(missing)}")
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _pard_token(raw: dict[str, Any], source: str | Path) -> int | None:
    """PARD checkpoints name their mask token `pard_token` (some `ptd_token_id`), P-EAGLE heads
    `mask_token_id`, as vLLM also reads them."""
    value = raw.get("pard_token", raw.get("ptd_token_id", raw.get("mask_token_id")))
    if value is None:
        return None
    in_vocab = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < int(raw.get("vocab_size", 0))
    if not in_vocab:
        raise CheckpointError(f"{source}: pard_token must be a token id below vocab_size, got {value!r}")
    return value


def _eos_ids(generation: dict[str, Any] | None, raw: dict[str, Any]) -> list[int]:
    """generation_config.json wins: chat models often list several EOS ids there only."""
    for source in (generation or {}, raw):
        eos = source.get("eos_token_id")
        if eos is not None:
            return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
    return []
