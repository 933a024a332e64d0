"""Mixture of experts as Qwen3-MoE has it: a router picks each token's top-k experts (softmax over all
experts, then the top k, renormalised when `norm_topk_prob`); each expert is a SwiGLU MLP.

Tensor parallelism splits every expert's intermediate dimension across the ranks (as vLLM does by default):
each rank runs every expert on its slice, and one all-reduce sums the partial outputs of all experts. The
experts' weights are stacked in two parameters, read from the checkpoint's per-expert tensors
(`mlp.experts.N.gate_proj / up_proj / down_proj`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minedraft.model.checkpoint import TensorSlice
from minedraft.model.config import ModelConfig
from minedraft.model.layers import _load_rows, _param, linear, replicated_loader
from minedraft.model.parallel import TensorParallel


class Router(nn.Module):
    """The gate: one logit per expert, replicated on every rank (checkpoint name `mlp.gate.weight`)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = _param((num_experts, hidden), replicated_loader)


class StackedExperts(nn.Module):
    """Every expert's gate/up projection in `w13` [experts, 2 x local, hidden] and down projection in `w2`
    [experts, hidden, local], local = this rank's share of the intermediate size."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TensorParallel,
                 batch_invariant: bool) -> None:
        super().__init__()
        if intermediate % tp.size:
            raise ValueError(f"moe_intermediate_size {intermediate} is not divisible by tensor-parallel size {tp.size}")
        self.tp, self.batch_invariant, self.local = tp, batch_invariant, intermediate // tp.size
        self.w13 = _param((num_experts, 2 * self.local, hidden), self._load_gate_up)
        self.w13.checkpoint_parts = [  # type: ignore[attr-defined]
            (f"{e}.{name}.weight", (e, slot))
            for e in range(num_experts)
            for slot, name in enumerate(("gate_proj", "up_proj"))
        ]
        self.w2 = _param((num_experts, hidden, self.local), self._load_down)
        self.w2.checkpoint_parts = [(f"{e}.down_proj.weight", e) for e in range(num_experts)]  # type: ignore[attr-defined]

    def _load_gate_up(self, param: nn.Parameter, source: TensorSlice, shard_id: object = None) -> None:
        expert, slot = shard_id  # type: ignore[misc]
        dst = param.data[expert].narrow(0, slot * self.local, self.local)
        _load_rows(dst, source, self.local * self.tp.size, self.tp.rank * self.local)

    def _load_down(self, param: nn.Parameter, source: TensorSlice, shard_id: object = None) -> None:
        _load_rows(param.data[shard_id], source, self.local * self.tp.size, self.tp.rank * self.local, dim=1)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over each token's experts ([tokens, k] ids and weights), expert by expert
        in ascending order: a token's result depends on its own experts only, whatever else is in the batch."""
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            tokens, slots = (experts == expert).nonzero(as_tuple=True)
            gate, up = linear(x[tokens], self.w13[expert], None, self.batch_invariant).chunk(2, dim=-1)
            y = linear(F.silu(gate) * up, self.w2[expert], None, self.batch_invariant)
            out.index_add_(0, tokens, y * weights[tokens, slots, None])
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, batch_invariant: bool) -> None:
        super().__init__()
        self.tp, self.batch_invariant = tp, batch_invariant
        self.top_k, self.normalise = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Router(config.hidden_size, config.num_experts)
        self.experts = StackedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size, tp,
                                      batch_invariant)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear(x, self.gate.weight, None, self.batch_invariant)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.tp.all_reduce(self.experts(x, experts, weights.to(x.dtype)))
