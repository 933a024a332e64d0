"""One decoder for Llama, Qwen2, Qwen3 and Qwen3-MoE (GQA; Qwen2 qkv bias; Qwen3 q/k norm and tied
embeddings; Qwen3-MoE routed experts in place of the MLP, model/moe.py).

Module names mirror the Hugging Face checkpoints, except the packed ``qkv_proj`` and ``gate_up_proj``,
which PACKED_MODULES maps back to their checkpoint tensors, and the stacked experts, whose parameters list
their own (``checkpoint_parts``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minedraft.model.attention import AttentionPlan, attend
from minedraft.model.checkpoint import CheckpointReader
from minedraft.model.config import ModelConfig
from minedraft.model.kv_cache import KVCache
from minedraft.model.layers import (
    LinearBase,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    pack_for_onednn,
    rms_normalize,
)
from minedraft.model.moe import SparseMoeBlock
from minedraft.model.parallel import TensorParallel

PACKED_MODULES: dict[str, tuple[tuple[str, str | int], ...]] = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
}


@dataclass
class ForwardContext:
    """What every layer needs besides hidden states: where tokens go in the cache, who attends to what."""

    positions: torch.Tensor  # [tokens]
    token_index: torch.Tensor  # [tokens] flat cache index (block * block_size + offset) of each token
    attention: AttentionPlan
    kv_cache: KVCache
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos and signed sin per token (RotaryEmbedding.table)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        self.layer = layer
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, config.qkv_bias, tp, batch_invariant)
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                        config.o_proj_bias, tp, batch_invariant)
        qk_norm = config.qk_norm
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext, fused: ModuleType | None = None) -> torch.Tensor:
        """fused: the fused kernels' module (triton_fused, cpu_fused), whose rope_write_kv does the q/k norm,
        rotation and the KV write in one kernel."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = ctx.kv_cache.k[self.layer], ctx.kv_cache.v[self.layer]
        q = self._fused_inputs(qkv, ctx, fused) if fused is not None else self._inputs(qkv, ctx)
        out = attend(q, k_cache, v_cache, ctx.attention, self.scale)
        return self.o_proj(out.reshape(tokens, -1))

    def _inputs(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q normed (Qwen3) and rotated; k likewise, written to the cache with v."""
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        # q and k heads side by side: their norms and rotation run as one op each.
        qk, v = qkv.view(qkv.shape[0], -1, self.head_dim).split([heads + kv_heads, kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            weight = torch.cat((self.q_norm.weight.expand(heads, -1), self.k_norm.weight.expand(kv_heads, -1)))
            qk = weight * rms_normalize(qk, self.q_norm.eps)
        assert ctx.rope is not None
        q, k = RotaryEmbedding.rotate(qk, ctx.rope).split([heads, kv_heads], dim=1)
        ctx.kv_cache.write(self.layer, ctx.token_index, k, v)
        return q

    def _fused_inputs(self, qkv: torch.Tensor, ctx: ForwardContext, kernels: ModuleType) -> torch.Tensor:
        assert ctx.rope is not None
        norm = None
        if self.q_norm is not None and self.k_norm is not None:
            norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return kernels.rope_write_kv(qkv, ctx.rope, ctx.token_index, ctx.kv_cache.k[self.layer],
                                     ctx.kv_cache.v[self.layer], self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads,
                                     norm)  # fmt: skip


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], config.mlp_bias, tp,
                                                       batch_invariant)
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, tp, batch_invariant)

    def forward(self, x: torch.Tensor, fused: ModuleType | None = None) -> torch.Tensor:
        """fused: the fused kernels' module, whose silu_and_mul computes SiLU(gate) * up."""
        gate_up = self.gate_up_proj(x)
        if fused is not None:
            return self.down_proj(fused.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, tp, batch_invariant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoeBlock(config, tp, batch_invariant) if layer in config.moe_layers else MLP(
            config, tp, batch_invariant)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext,
                      kernels: ModuleType) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused kernels' form (vLLM's): x is the last sublayer's output, not yet added to the residual
        stream (None: x is the stream), so each add is fused with the norm after it. Returns the same pair."""
        h, residual = _add_norm(kernels, self.input_layernorm, x, residual)
        h, residual = _add_norm(kernels, self.post_attention_layernorm, self.self_attn(h, ctx, fused=kernels),
                                residual)  # fmt: skip
        return self.mlp(h, fused=kernels) if isinstance(self.mlp, MLP) else self.mlp(h), residual


def _add_norm(kernels: ModuleType, norm: RMSNorm, x: torch.Tensor,
              residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) in one kernel; residual None: (norm(x), x)."""
    return kernels.add_rms_norm(x, residual, norm.weight, norm.eps)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, batch_invariant)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, tp, batch_invariant) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # EAGLE heads' features, every token, concatenated in this order: hidden state i as transformers'
        # output_hidden_states counts them (i < layers: the residual stream entering layer i, EAGLE-3; i ==
        # layers: the last one after the final norm, EAGLE-1).
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None
        # The fused kernels for the norms, rotary + KV write and SiLU-and-mul: model/kernels/triton_fused.py on CUDA,
        # model/kernels/cpu_fused.py on CPU (the runner decides at start-up: the default mode). None: torch's ops.
        self.fused_kernels: ModuleType | None = None
        # A step of short queries through the layers, final norm and LM head as one C call (model/kernels/cpu_stack.py;
        # ModelRunner.forward runs it), where the runner runs the C fused kernels. None: the layers as below.
        self.decode_stack: Any = None

    def inputs(self, input_ids: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, ForwardContext]:
        """The embeddings, and the context with its tokens' rotary table (computed once per forward)."""
        x = self.embed_tokens(input_ids)
        return x, replace(ctx, rope=self.rotary.table(ctx.positions, x.dtype))

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, ctx = self.inputs(input_ids, ctx)
        captured: dict[int, torch.Tensor] = {}
        x = self._layers(x, ctx, captured) if self.fused_kernels is None else self._fused_layers(x, ctx, captured)
        if self.aux_layers:
            if len(self.layers) in self.aux_layers:
                captured[len(self.layers)] = self.final_norm(x)
            self.aux_hidden = torch.cat([captured[i] for i in self.aux_layers], dim=-1)
        return x  # the final norm is applied by CausalLM to the rows that need logits only

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) if self.fused_kernels is None else _add_norm(self.fused_kernels, self.norm, x, None)[0]

    def _layers(self, x: torch.Tensor, ctx: ForwardContext, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                captured[i] = x
            x = layer(x, ctx)
        return x

    def _fused_layers(self, x: torch.Tensor, ctx: ForwardContext, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        """The layers in forward_fused's form; returns the residual stream after the last one."""
        residual = None
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:  # an EAGLE head reads the stream entering layer i: add it here
                x, residual = x if residual is None else x + residual, None
                captured[i] = x
            x, residual = layer.forward_fused(x, residual, ctx, self.fused_kernels)
        return x + residual


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        self.model = DecoderModel(config, max_positions, tp, batch_invariant)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, batch_invariant)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids, ctx)[logits_indices]
        return self.lm_head(self.model.final_norm(hidden))

    def pack_weights(self) -> None:
        """Hold every linear layer's weight in oneDNN's layout instead, and the LM head's beside its own,
        where that applies (layers.pack_for_onednn). Not for the strict kernels, whose fixed-shape GEMMs
        are the point."""
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.pack()
        if not self.lm_head.batch_invariant:
            self.lm_head.packed = pack_for_onednn(self.lm_head.weight)

    def load_weights(self, reader: CheckpointReader) -> None:
        """Fill every parameter from the checkpoint; each parameter's loader reads only its shard."""
        for name, param in self.named_parameters():
            for tensor_name, shard_id in checkpoint_sources(name, param):
                param.weight_loader(param, reader.tensor(tensor_name), shard_id)  # type: ignore[attr-defined]


def checkpoint_sources(param_name: str, param: nn.Parameter | None = None) -> list[tuple[str, object]]:
    """Checkpoint tensors (and their shard ids) that make up one model parameter."""
    parts_of_param = getattr(param, "checkpoint_parts", None)
    if parts_of_param is not None:  # named relative to the parameter's module
        module = param_name.rsplit(".", 1)[0]
        return [(f"{module}.{part}", shard) for part, shard in parts_of_param]
    for packed, parts in PACKED_MODULES.items():
        if f".{packed}." in param_name:
            return [(param_name.replace(packed, part), shard) for part, shard in parts]
    return [(param_name, None)]
