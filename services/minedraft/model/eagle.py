"""EAGLE-3 draft heads: one decoder layer fed with the target's hidden states from three of its layers.

Position p of a sequence takes the token t_{p+1} and a hidden input: at first the target's features
g_p = fc(concat of the target's residual stream entering three of its layers at position p), then, while
drafting, the head's own output at the position before. The layer reads
concat(input_layernorm(embedding), hidden_norm(hidden)) (twice the hidden size) in its q/k/v projections,
adds attention to the hidden input as the residual, then an MLP; its output, normed, gives logits over
the draft vocabulary, mapped to target ids by `d2t` (target id = draft id + d2t[draft id]). Its KV cache
holds one layer.

P-EAGLE heads (parallel drafting) also carry `mask_hidden`, the target states every masked position of a
one-forward window stands on, and name their mask token (`mask_token_id`) in config.json.

Checkpoint layouts read: EAGLE-3's (`LlamaForCausalLMEagle3`: `midlayer.*`, `fc.weight`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`, `embed_tokens.weight` optional) and the `speculators` one (`layers.0.*`
for `midlayer.*`, the layer's config nested in `transformer_layer_config`). Without its own embedding
the head reads the target's (`model.embed_tokens.weight`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from minedraft.model.attention import attend
from minedraft.model.checkpoint import CheckpointError, CheckpointReader
from minedraft.model.config import ModelConfig
from minedraft.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minedraft.model.parallel import TensorParallel
from minedraft.model.transformer import MLP, ForwardContext, checkpoint_sources

TARGET_EMBEDDING = "model.embed_tokens.weight"


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers whose input an EAGLE-3 head reads when its config names none (low, middle, high)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


class Eagle3Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        self.head_dim, self.scale = config.head_dim, config.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(2 * config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, False, tp, batch_invariant)  # fmt: skip
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size, False, tp,
                                        batch_invariant)  # fmt: skip

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        qk, v = self.qkv_proj(x).view(tokens, -1, self.head_dim).split([heads + kv_heads, kv_heads], dim=1)
        assert ctx.rope is not None
        q, k = RotaryEmbedding.rotate(qk, ctx.rope).split([heads, kv_heads], dim=1)
        ctx.kv_cache.write(0, ctx.token_index, k, v)
        out = attend(q, ctx.kv_cache.k[0], ctx.kv_cache.v[0], ctx.attention, self.scale)
        return self.o_proj(out.reshape(tokens, -1))


class Eagle3Layer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on the token embeddings
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on the hidden input
        self.self_attn = Eagle3Attention(config, tp, batch_invariant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp, batch_invariant)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        h = hidden + self.self_attn(x, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """forward(input_ids, ctx, logits_indices, hidden) -> (logits over the target vocabulary, the layer's
    output at the logits rows: the hidden input of the next drafting step)."""

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        if tp.size != 1:
            raise ValueError("an EAGLE-3 head runs on one device (draft_tensor_parallel_size 1)")
        hidden = config.hidden_size
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp, batch_invariant)
        self.fc = ColumnParallelLinear(3 * hidden, hidden, False, tp, batch_invariant)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, max_positions)
        self.midlayer = Eagle3Layer(config, tp, batch_invariant)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.draft_vocab_size, hidden, tp, batch_invariant)
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=False)
        # P-EAGLE: the target states a masked position stands on (the checkpoint's `mask_hidden`), if any.
        self.mask_hidden: torch.Tensor | None = None

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's three layers' states [tokens, 3 x hidden] -> the head's hidden input [tokens, hidden]."""
        return self.fc(target_hidden.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        embeds = self.embed_tokens(input_ids)
        ctx = replace(ctx, rope=self.rotary.table(ctx.positions, embeds.dtype))
        out = self.midlayer(embeds, hidden.to(embeds.dtype), ctx)[logits_indices]
        draft_logits = self.lm_head(self.norm(out)).float()
        if draft_logits.shape[-1] == self.vocab_size:
            return draft_logits, out
        logits = torch.full((len(out), self.vocab_size), float("-inf"), device=out.device)
        return logits.index_copy_(1, self.draft_to_target, draft_logits), out

    def pack_weights(self) -> None:
        """No oneDNN packing: a head's step is small next to the target's."""

    def load_weights(self, reader: CheckpointReader, target: CheckpointReader | None) -> None:
        """Fill every parameter from the head's checkpoint in either layout; the embedding from the head's
        own `embed_tokens.weight` or else from the target's checkpoint."""
        prefix = "midlayer." if any(name.startswith("midlayer.") for name in reader.weight_map) else "layers.0."
        for name, param in self.named_parameters():
            for tensor_name, shard_id in checkpoint_sources(name, param):
                source = _head_tensor(reader, target, tensor_name.replace("midlayer.", prefix, 1))
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


def _head_tensor(reader: CheckpointReader, target: CheckpointReader | None, name: str):
    if name in reader:
        return reader.tensor(name)
    if name == "embed_tokens.weight" and target is not None and TARGET_EMBEDDING in target:
        return target.tensor(TARGET_EMBEDDING)
    where = " nor the target's" if name == "embed_tokens.weight" else ""
    raise CheckpointError(f"{reader.folder}: the EAGLE-3 head's checkpoint{where} has no tensor {name}")

