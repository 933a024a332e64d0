"""Tiny random Hugging Face checkpoints for tests (no downloads).

``make_tiny_checkpoint`` writes config.json, model.safetensors (or shards), generation_config.json and a
byte-level BPE tokenizer.json, exactly as ``save_pretrained`` would for a real model, so the runner is
tested against files it did not write. Reuse it to build random target/draft pairs:

    target = make_tiny_checkpoint(tmp_path / "target", "qwen3", num_layers=2, seed=0)
    draft = make_tiny_checkpoint(tmp_path / "draft", "qwen3", num_layers=1, hidden_size=32, seed=1)

Both share the tokenizer as long as vocab_size matches.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from minedraft.model.layers import RotaryEmbedding, rms_normalize
from minedraft.model.runner import SeqInput

ARCHS = ("llama", "llama3", "qwen2", "qwen3", "qwen3_moe")  # llama3 = Llama with llama3 rope scaling
# qwen3_moe: 4 experts of intermediate size 32, top 2, the last layer dense (mlp_only_layers)
MOE_KWARGS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
BOS_ID, EOS_ID, PAD_ID = 1, 2, 0
_SPECIALS = ["<pad>", "<s>", "</s>"]


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "qwen3",
    *,
    vocab_size: int = 320,
    hidden_size: int = 64,
    intermediate_size: int | None = None,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    init_std: float = 0.1,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
) -> Path:
    """Write a random `arch` checkpoint to `path`. Qwen3 defaults to an explicit head_dim of
    2 * hidden / heads (so head_dim != hidden / heads) and tied embeddings, like the real small Qwen3s.
    `init_std` is larger than HF's 0.02 so that logits are peaked and numerical slips are visible."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}")
    path = Path(path)
    model = _random_model(
        arch, seed=seed, init_std=init_std, vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        head_dim=head_dim or (2 * hidden_size // num_heads if arch.startswith("qwen3") else hidden_size // num_heads),
        tie_word_embeddings=(arch == "qwen3") if tie_word_embeddings is None else tie_word_embeddings,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    shard_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(path, safe_serialization=True, **shard_kwargs)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID]}))
    write_tokenizer(path, vocab_size, add_bos=arch.startswith("llama"))
    return path


def _random_model(arch: str, *, seed: int, init_std: float, **config_kwargs):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )  # fmt: skip

    if arch == "llama3":
        config_kwargs["rope_scaling"] = {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,  # small, so test positions cross every band
        }
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM), "llama3": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }[arch]
    if arch == "qwen2":
        config_kwargs.pop("head_dim")  # Qwen2 derives it
    if arch == "qwen3_moe":
        config_kwargs.update(MOE_KWARGS, mlp_only_layers=[config_kwargs["num_hidden_layers"] - 1])
    model = model_cls(config_cls(**config_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):  # not all ones, so a norm loaded wrongly shows up
                param.copy_(1.0 + 0.2 * noise)
            else:  # biases too: HF zero-inits them, which would hide an unloaded bias
                param.copy_(init_std * noise)
    return model.eval()


def write_tokenizer(path: Path, vocab_size: int, *, add_bos: bool) -> None:
    """A byte-level BPE tokenizer.json of exactly vocab_size ids: specials, the 256 bytes, fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(_SPECIALS) + len(alphabet):
        raise ValueError(f"vocab_size must be at least {len(_SPECIALS) + len(alphabet)} for a byte-level tokenizer")
    tokens = _SPECIALS + sorted(alphabet)
    tokens += [f"<x{i}>" for i in range(vocab_size - len(tokens))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_SPECIALS)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", BOS_ID)])
    tok.save(str(path / "tokenizer.json"))


def load_hf_model(path: str | Path):
    """The transformers reference model (eager attention, float32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Tiny models run fastest single-threaded; on a busy shared CPU, OpenMP spin-waits of a second
    thread can slow them down tenfold. Restored afterwards so other tests keep their setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def assert_runners_agree(runner, reference, tolerance: float) -> None:
    """Prefill, decode and a verification window of three sequences at once, through every layer of two
    ModelRunners of the same checkpoint (fresh ones, their first three slots): logits equal within `tolerance`."""
    rng = random.Random(0)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (3, 18, 40)]
    steps = [[SeqInput(i, p, 0, num_logits=1) for i, p in enumerate(prompts)]]
    steps.append([SeqInput(i, [7], len(p)) for i, p in enumerate(prompts)])
    steps.append([SeqInput(i, [9, 4, 11, 2, 5], len(p) + 1, num_logits=5) for i, p in enumerate(prompts)])
    for each in (runner, reference):
        for _ in prompts:
            each.allocate_slot()
    for step in steps:
        torch.testing.assert_close(runner.forward(step), reference.forward(step), atol=tolerance, rtol=tolerance)


def make_eagle3_head(
    path: str | Path,
    *,
    hidden_size: int,
    vocab_size: int,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    draft_vocab_size: int | None = None,
    draft_ids: list[int] | None = None,
    aux_layers: list[int] | None = None,
    layout: str = "eagle3",
    with_embedding: bool = False,
    mask_token_id: int | None = None,
    seed: int = 0,
    init_std: float = 0.05,
) -> Path:
    """Write a random EAGLE-3 head: EAGLE-3's layout (`midlayer.*`, LlamaForCausalLMEagle3) or the
    `speculators` one (`layers.0.*`, the layer's config nested in transformer_layer_config). With a draft
    vocabulary smaller than the target's, `d2t` maps draft id i to target id 2 i (every other id), or to
    `draft_ids[i]` when given. With `mask_token_id`, a P-EAGLE head: `mask_hidden` [1, 3 x hidden] too."""
    from safetensors.torch import save_file

    if layout not in ("eagle3", "speculators"):
        raise ValueError("layout must be eagle3 or speculators")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    head_dim = head_dim or hidden_size // num_heads
    inter = intermediate_size or 2 * hidden_size
    draft_vocab = len(draft_ids) if draft_ids else draft_vocab_size or vocab_size
    rand = lambda *shape: torch.randn(*shape, generator=gen) * init_std  # noqa: E731
    norm = lambda: 1 + torch.randn(hidden_size, generator=gen) * 0.1  # noqa: E731
    layer = "midlayer" if layout == "eagle3" else "layers.0"
    tensors = {
        "fc.weight": rand(hidden_size, 3 * hidden_size),
        f"{layer}.input_layernorm.weight": norm(),
        f"{layer}.hidden_norm.weight": norm(),
        f"{layer}.self_attn.q_proj.weight": rand(num_heads * head_dim, 2 * hidden_size),
        f"{layer}.self_attn.k_proj.weight": rand(num_kv_heads * head_dim, 2 * hidden_size),
        f"{layer}.self_attn.v_proj.weight": rand(num_kv_heads * head_dim, 2 * hidden_size),
        f"{layer}.self_attn.o_proj.weight": rand(hidden_size, num_heads * head_dim),
        f"{layer}.post_attention_layernorm.weight": norm(),
        f"{layer}.mlp.gate_proj.weight": rand(inter, hidden_size),
        f"{layer}.mlp.up_proj.weight": rand(inter, hidden_size),
        f"{layer}.mlp.down_proj.weight": rand(hidden_size, inter),
        "norm.weight": norm(),
        "lm_head.weight": rand(draft_vocab, hidden_size) * 20,
    }
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(vocab_size, hidden_size) * 20
    if mask_token_id is not None:
        tensors["mask_hidden"] = torch.randn(1, 3 * hidden_size, generator=gen)
    if draft_vocab != vocab_size:
        targets = torch.tensor(draft_ids) if draft_ids else 2 * torch.arange(draft_vocab)
        tensors["d2t"] = targets - torch.arange(draft_vocab)  # target id = draft id + d2t[draft id]
        tensors["t2d"] = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, targets, True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    fields = {
        "hidden_size": hidden_size, "intermediate_size": inter, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 1024, "vocab_size": vocab_size, "num_hidden_layers": 1, "model_type": "llama",
    }  # fmt: skip
    extra: dict = {"draft_vocab_size": draft_vocab}
    if mask_token_id is not None:
        extra["mask_token_id"] = mask_token_id
    if aux_layers:
        extra["eagle_aux_hidden_state_layer_ids"] = aux_layers
    if layout == "eagle3":
        config = {"architectures": ["LlamaForCausalLMEagle3"], **fields, **extra}
    else:
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": {**fields, "architectures": ["LlamaForCausalLM"]}, **extra}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def make_eagle_head(
    path: str | Path,
    *,
    hidden_size: int,
    vocab_size: int,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    num_layers: int = 1,
    fc_bias: bool = True,
    with_embedding: bool = False,
    with_lm_head: bool = False,
    para_norm: bool = False,
    file_format: str = "safetensors",
    seed: int = 0,
    init_std: float = 0.05,
) -> Path:
    """Write a random EAGLE-1 head as the published ones are: a plain LlamaConfig, `fc.weight` [hidden,
    2 x hidden] (and `fc.bias` by default, as EAGLE's reference has it), Llama decoder layers `layers.N.*`
    whose layer 0 has no input_layernorm, no final norm; optionally its own `embed_tokens.weight` and
    `lm_head.weight`, and the HASS norms (`add_para_norm`). file_format: safetensors (model.safetensors) or
    bin (pytorch_model.bin, a torch.save'd state dict)."""
    if file_format not in ("safetensors", "bin"):
        raise ValueError("file_format must be safetensors or bin")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    head_dim = head_dim or hidden_size // num_heads
    inter = intermediate_size or 2 * hidden_size
    rand = lambda *shape: torch.randn(*shape, generator=gen) * init_std  # noqa: E731
    norm = lambda: 1 + torch.randn(hidden_size, generator=gen) * 0.1  # noqa: E731
    tensors = {"fc.weight": rand(hidden_size, 2 * hidden_size)}
    if fc_bias:
        tensors["fc.bias"] = rand(hidden_size)
    for i in range(num_layers):
        layer = f"layers.{i}"
        if i > 0:
            tensors[f"{layer}.input_layernorm.weight"] = norm()
        tensors.update({
            f"{layer}.self_attn.q_proj.weight": rand(num_heads * head_dim, hidden_size),
            f"{layer}.self_attn.k_proj.weight": rand(num_kv_heads * head_dim, hidden_size),
            f"{layer}.self_attn.v_proj.weight": rand(num_kv_heads * head_dim, hidden_size),
            f"{layer}.self_attn.o_proj.weight": rand(hidden_size, num_heads * head_dim),
            f"{layer}.post_attention_layernorm.weight": norm(),
            f"{layer}.mlp.gate_proj.weight": rand(inter, hidden_size),
            f"{layer}.mlp.up_proj.weight": rand(inter, hidden_size),
            f"{layer}.mlp.down_proj.weight": rand(hidden_size, inter),
        })  # fmt: skip
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(vocab_size, hidden_size) * 20
    if with_lm_head:
        tensors["lm_head.weight"] = rand(vocab_size, hidden_size) * 20
    if para_norm:
        tensors["embedding_layernorm.weight"] = norm()
        tensors["hidden_states_layernorm.weight"] = norm()
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if file_format == "bin":
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden_size,
        "intermediate_size": inter, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "num_hidden_layers": num_layers, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 1024, "vocab_size": vocab_size, "hidden_act": "silu", "bias": fc_bias,
        **({"add_para_norm": True} if para_norm else {}),
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def read_head_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a head written by make_eagle_head or make_eagle3_head, whichever file it has."""
    path = Path(path)
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", weights_only=True)
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def unfused_qkv(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], heads: int, kv_heads: int, head_dim: int,
                norm: tuple[torch.Tensor, torch.Tensor, float] | None):
    """What transformer.Attention computes unfused, for the fused kernels' tests: q, k and v per head (KVCache.write
    stores k and v)."""
    qk, v = qkv.view(qkv.shape[0], -1, head_dim).split([heads + kv_heads, kv_heads], dim=1)
    if norm is not None:
        weight = torch.cat((norm[0].expand(heads, -1), norm[1].expand(kv_heads, -1)))
        qk = weight * rms_normalize(qk, norm[2])
    q, k = RotaryEmbedding.rotate(qk, rope).split([heads, kv_heads], dim=1)
    return q, k, v


# GGUF names of a layer's tensors (llama.cpp's), and the metadata keys the engine reads.
_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def write_gguf(checkpoint: str | Path, path: str | Path, quant: str = "F32", arch: str | None = None,
               tensor_types: dict[str, str] | None = None) -> Path:  # fmt: skip
    """The HF checkpoint written as llama.cpp's converter writes it, with the `gguf` library: metadata, the
    byte-level vocabulary of write_tokenizer, Llama's Q/K rows permuted as llama.cpp does, 2-D weights
    stored as `quant` (or per tensor, by GGUF name, as `tensor_types` say). `arch` overrides the file's
    architecture (to test a refusal)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize
    from safetensors.torch import load_file

    checkpoint, path = Path(checkpoint), Path(path)
    config = json.loads((checkpoint / "config.json").read_text())
    kind = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[
        config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = GGUFWriter(str(path), arch or kind)
    a = arch or kind
    writer.add_uint32(f"{a}.block_count", config["num_hidden_layers"])
    writer.add_uint32(f"{a}.context_length", config["max_position_embeddings"])
    writer.add_uint32(f"{a}.embedding_length", config["hidden_size"])
    writer.add_uint32(f"{a}.feed_forward_length", config["intermediate_size"])
    writer.add_uint32(f"{a}.attention.head_count", heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", kv_heads)
    writer.add_uint32(f"{a}.attention.key_length", config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_uint32(f"{a}.attention.value_length", config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_float32(f"{a}.rope.freq_base", float(config.get("rope_theta")
                                                     or config.get("rope_parameters", {}).get("rope_theta", 1e4)))
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    writer.add_uint32(f"{a}.vocab_size", config["vocab_size"])
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([TokenType.CONTROL if t in _SPECIALS else TokenType.NORMAL for t, _ in vocab])
    writer.add_token_merges([])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(kind == "llama")
    writer.add_chat_template(TEMPLATE)
    for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
        gguf_name = _gguf_name(name)
        values = tensor.float().numpy()
        if kind == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else kv_heads
            values = values.reshape(n, 2, values.shape[0] // n // 2, *values.shape[1:]).swapaxes(1, 2).reshape(
                values.shape)
        stored = (tensor_types or {}).get(gguf_name, quant if values.ndim == 2 else "F32")
        qtype = GGMLQuantizationType[stored]
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(gguf_name, values.astype(np.float32 if stored == "F32" else np.float16))
        elif qtype == GGMLQuantizationType.I8:
            writer.add_tensor(gguf_name, values.astype(np.int8))
        elif stored in _K_QUANT_SCALES:
            writer.add_tensor(gguf_name, _random_k_quant(values.shape, stored), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The gguf library dequantizes K-quants but cannot quantize to them: such tensors get random codes, with their
# float16 block scales (at these byte offsets of each block) set small, so the weights stay in range.
_K_QUANT_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (-2,)}


def _random_k_quant(shape: tuple[int, ...], kind: str, seed: int = 0):
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rows, cols = shape
    codes = np.random.default_rng(seed).integers(0, 256, size=(rows, cols // block, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    for offset in _K_QUANT_SCALES[kind]:
        start = offset % block_bytes
        codes[:, :, start:start + 2] = scale
    return codes.reshape(rows, -1)


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"
