"""EAGLE draft heads of both kinds: EAGLE-1 (`method: eagle`) and EAGLE-3 (`method: eagle3`).

A head drafts from the target's own states. Position p of a sequence takes the token t_{p+1} and a hidden
input: at first a feature of the target at position p, then, while drafting, the head's own output at the
position before. Its KV cache holds the head's layers. The kinds differ in the feature and in the layers
between it and the logits.

EAGLE-1 (the `yuhuili/EAGLE-*` heads): the feature h_p is the target's last hidden state after its final
norm, what the target's LM head reads. x = fc(concat(embed(t_{p+1}), h_p)) (plus `fc.bias` where the
checkpoint has one), then ordinary Llama decoder layers (`layers.N.*`) except that layer 0 has no input
norm; the output o_p, not normed, gives logits over the full target vocabulary through the head's own
`lm_head.weight`, else the target's LM head. config.json is a plain LlamaConfig, so only the weights tell a
head (`fc.weight`, no `model.*`) from a draft model. HASS heads (`add_para_norm`) RMS-normalise the
embedding and the hidden input before the concat (`embedding_layernorm`, `hidden_states_layernorm`).
Published heads are often `pytorch_model.bin`: model/checkpoint.py reads it with torch's safe unpickler.

EAGLE-3: the feature is the concat of the target's residual stream entering three of its layers, fused by
`fc` into the hidden input. One decoder layer reads concat(input_layernorm(embedding), hidden_norm(hidden))
(twice the hidden size) in its q/k/v projections, adds attention to the hidden input as the residual, then
an MLP; its output, normed, gives logits over the draft vocabulary, mapped to target ids by `d2t` (target
id = draft id + d2t[draft id]).

P-EAGLE heads (EAGLE-3, parallel drafting) also carry `mask_hidden`, the target states every masked
position of a one-forward window stands on, and name their mask token (`mask_token_id`) in config.json.

EAGLE-3 checkpoint layouts read: EAGLE-3's (`LlamaForCausalLMEagle3`: `midlayer.*`, `fc.weight`,
`norm.weight`, `lm_head.weight`, `d2t`, `t2d`, `embed_tokens.weight` optional) and the `speculators` one
(`layers.0.*` for `midlayer.*`, the layer's config nested in `transformer_layer_config`). Without its own
embedding a head of either kind reads the target's (`model.embed_tokens.weight`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from minedraft.model import layers
from minedraft.model.attention import attend
from minedraft.model.checkpoint import CheckpointError, CheckpointReader, find_weight_files
from minedraft.model.config import ModelConfig
from minedraft.model.gguf import is_gguf
from minedraft.model.parallel import TensorParallel
from minedraft.model.transformer import MLP, DecoderLayer, ForwardContext, checkpoint_sources

EAGLE, EAGLE3 = "eagle", "eagle3"  # the head kinds, named as the speculative config's methods
TARGET_EMBEDDING = "model.embed_tokens.weight"
TARGET_LM_HEAD = "lm_head.weight"
_DERIVED = ("rotary_emb.inv_freq",)  # buffers old checkpoints saved that config.json determines


def eagle_head_kind(folder: Path, config: ModelConfig) -> str | None:
    """EAGLE3 for an EAGLE-3 head (its architecture says so), EAGLE for an EAGLE-1 head (a LlamaConfig whose
    weights have `fc.weight` and no `model.*` decoder), None for anything else."""
    if config.is_eagle3:
        return EAGLE3
    if config.architecture != "LlamaForCausalLM" or is_gguf(folder):
        return None
    return EAGLE if is_eagle1_checkpoint(find_weight_files(folder)) else None


def is_eagle1_checkpoint(names: Iterable[str]) -> bool:
    names = list(names)
    return "fc.weight" in names and not any(n.startswith("model.") for n in names)


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers whose input an EAGLE-3 head reads when its config names none (low, middle, high)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


class Eagle3Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        hidden, heads, kv_heads, head_dim = (config.hidden_size, config.num_attention_heads,
                                             config.num_key_value_heads, config.head_dim)  # fmt: skip
        self.head_dim, self.scale = head_dim, head_dim**-0.5
        self.qkv_proj = layers.QKVParallelLinear(2 * hidden, head_dim, heads, kv_heads, False, tp, batch_invariant)
        self.o_proj = layers.RowParallelLinear(heads * head_dim, hidden, False, tp, batch_invariant)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        qk, v = self.qkv_proj(x).view(tokens, -1, self.head_dim).split([heads + kv_heads, kv_heads], dim=1)
        assert ctx.rope is not None
        q, k = layers.RotaryEmbedding.rotate(qk, ctx.rope).split([heads, kv_heads], dim=1)
        ctx.kv_cache.write(0, ctx.token_index, k, v)
        out = attend(q, ctx.kv_cache.k[0], ctx.kv_cache.v[0], ctx.attention, self.scale)
        return self.o_proj(out.reshape(tokens, -1))


class Eagle3Layer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        self.input_layernorm = layers.RMSNorm(config.hidden_size, config.rms_norm_eps)  # on the token embeddings
        self.hidden_norm = layers.RMSNorm(config.hidden_size, config.rms_norm_eps)  # on the hidden input
        self.self_attn = Eagle3Attention(config, tp, batch_invariant)
        self.post_attention_layernorm = layers.RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp, batch_invariant)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        h = hidden + self.self_attn(x, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    """forward(input_ids, ctx, logits_indices, hidden) -> (logits over the target vocabulary, the head's
    output at the logits rows: the hidden input of the next drafting step). `kind`: EAGLE or EAGLE3."""

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel, batch_invariant: bool,
                 kind: str = EAGLE3, fc_bias: bool = False) -> None:  # fmt: skip
        super().__init__()
        if tp.size != 1:
            raise ValueError("an EAGLE head runs on one device (draft_tensor_parallel_size 1)")
        if kind not in (EAGLE, EAGLE3):
            raise ValueError(f"unknown EAGLE head kind {kind!r}: use {EAGLE} or {EAGLE3}")
        hidden = config.hidden_size
        self.kind, self.vocab_size = kind, config.vocab_size
        self.embed_tokens = layers.VocabParallelEmbedding(config.vocab_size, hidden, tp, batch_invariant)
        self.rotary = layers.RotaryEmbedding(config.head_dim, config.rope, max_positions)
        # P-EAGLE: the target states a masked position stands on (the checkpoint's `mask_hidden`), if any.
        self.mask_hidden: torch.Tensor | None = None
        if kind == EAGLE3:
            self.fc = layers.ColumnParallelLinear(3 * hidden, hidden, False, tp, batch_invariant)
            self.midlayer = Eagle3Layer(config, tp, batch_invariant)
            self.norm = layers.RMSNorm(hidden, config.rms_norm_eps)
            self.lm_head = layers.ParallelLMHead(config.draft_vocab_size, hidden, tp, batch_invariant)
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=False)
            return
        para_norm = lambda: layers.RMSNorm(hidden, config.rms_norm_eps) if config.add_para_norm else None  # noqa: E731
        self.embedding_layernorm, self.hidden_states_layernorm = para_norm(), para_norm()
        self.fc = layers.ColumnParallelLinear(2 * hidden, hidden, fc_bias, tp, batch_invariant)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp, batch_invariant)
                                    for i in range(config.num_hidden_layers))  # fmt: skip
        self.layers[0].input_layernorm = nn.Identity()  # fc's output enters the first layer as it is
        self.lm_head = layers.ParallelLMHead(config.vocab_size, hidden, tp, batch_invariant)

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's features [tokens, width] -> the head's hidden input [tokens, hidden]: EAGLE-3 fuses
        three layers' states with fc; an EAGLE-1 feature is the hidden input itself."""
        dtype = self.fc.weight.dtype
        return self.fc(target_hidden.to(dtype)) if self.kind == EAGLE3 else target_hidden.to(dtype)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        embeds = self.embed_tokens(input_ids)
        ctx = replace(ctx, rope=self.rotary.table(ctx.positions, embeds.dtype))
        hidden = hidden.to(embeds.dtype)
        if self.kind == EAGLE3:
            out = self.midlayer(embeds, hidden, ctx)[logits_indices]
            return self._to_target_vocabulary(self.lm_head(self.norm(out)).float()), out
        x = self.fc(torch.cat((_maybe(self.embedding_layernorm, embeds), _maybe(self.hidden_states_layernorm, hidden)),
                              dim=-1))  # fmt: skip
        for layer in self.layers:
            x = layer(x, ctx)
        out = x[logits_indices]
        return self.lm_head(out).float(), out

    def _to_target_vocabulary(self, draft_logits: torch.Tensor) -> torch.Tensor:
        if draft_logits.shape[-1] == self.vocab_size:
            return draft_logits
        logits = torch.full((len(draft_logits), self.vocab_size), float("-inf"), device=draft_logits.device)
        return logits.index_copy_(1, self.draft_to_target, draft_logits)

    def pack_weights(self) -> None:
        """No oneDNN packing: a head's step is small next to the target's."""

    def load_weights(self, reader: CheckpointReader, target: CheckpointReader | None) -> None:
        """Fill every parameter from the head's checkpoint; the embedding (and an EAGLE-1 head's LM head)
        from the target's checkpoint where the head's has none."""
        if self.kind == EAGLE:
            self._load_eagle1(reader, target)
        else:
            self._load_eagle3(reader, target)

    def _load_eagle1(self, reader: CheckpointReader, target: CheckpointReader | None) -> None:
        read: set[str] = set()
        for name, param in self.named_parameters():
            for tensor_name, shard_id in checkpoint_sources(name, param):
                read.add(tensor_name)
                param.weight_loader(param, _head_tensor(reader, target, tensor_name, EAGLE), shard_id)  # type: ignore[attr-defined]
        unread = sorted(n for n in reader.weight_map if n not in read and not n.endswith(_DERIVED))
        if unread:  # e.g. layers.0.input_layernorm.weight, which the format does not have: never drop weights
            raise CheckpointError(f"{reader.folder}: the EAGLE-1 head's checkpoint has tensors the format does not "
                                  f"use: {', '.join(unread[:4])}{' ...' if len(unread) > 4 else ''}")  # fmt: skip

    def _load_eagle3(self, reader: CheckpointReader, target: CheckpointReader | None) -> None:
        prefix = "midlayer." if any(name.startswith("midlayer.") for name in reader.weight_map) else "layers.0."
        for name, param in self.named_parameters():
            for tensor_name, shard_id in checkpoint_sources(name, param):
                source = _head_tensor(reader, target, tensor_name.replace("midlayer.", prefix, 1), EAGLE3)
                param.weight_loader(param, source, shard_id)  # type: ignore[attr-defined]
        if "mask_hidden" in reader:
            mask = reader.tensor("mask_hidden").read().reshape(-1)
            if mask.numel() != self.fc.weight.shape[1]:
                raise CheckpointError(f"{reader.folder}: mask_hidden has {mask.numel()} values, expected "
                                      f"{self.fc.weight.shape[1]} (3 x hidden_size)")  # fmt: skip
            self.mask_hidden = mask.to(self.fc.weight.device, self.fc.weight.dtype)
        if "d2t" in reader:
            offsets = reader.tensor("d2t").read().to(torch.int64)
            if offsets.shape != self.draft_to_target.shape:
                raise CheckpointError(f"{reader.folder}: d2t has shape {tuple(offsets.shape)}, expected "
                                      f"{tuple(self.draft_to_target.shape)} (draft_vocab_size)")  # fmt: skip
            ids = self.draft_to_target.cpu() + offsets
            if ids.min() < 0 or ids.max() >= self.vocab_size:
                raise CheckpointError(f"{reader.folder}: d2t maps draft ids outside the target vocabulary")
            self.draft_to_target.copy_(ids)
        elif self.lm_head.vocab_size != self.vocab_size:
            raise CheckpointError(f"{reader.folder}: draft_vocab_size {self.lm_head.vocab_size} differs from "
                                  f"vocab_size {self.vocab_size} but the checkpoint has no d2t map")  # fmt: skip


def _maybe(norm: layers.RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


def _head_tensor(reader: CheckpointReader, target: CheckpointReader | None, name: str, kind: str):
    """The head's tensor `name`; its embedding, and an EAGLE-1 head's LM head, else the target's (the LM head
    of a target with tied embeddings is its embedding)."""
    if name in reader:
        return reader.tensor(name)
    fallbacks = {"embed_tokens.weight": [TARGET_EMBEDDING]}
    if kind == EAGLE:
        fallbacks["lm_head.weight"] = [TARGET_LM_HEAD, TARGET_EMBEDDING]
    for source in fallbacks.get(name, []):
        if target is not None and source in target:
            return target.tensor(source)
    where = " nor the target's" if name in fallbacks else ""
    label = "EAGLE-1" if kind == EAGLE else "EAGLE-3"
    raise CheckpointError(f"{reader.folder}: the {label} head's checkpoint{where} has no tensor {name}")
