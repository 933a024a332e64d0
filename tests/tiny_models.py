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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

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
