"""Mixture of experts as Qwen3-MoE has it: a router picks each token's top-k experts (softmax over all
experts, then the top k, renormalised when `norm_topk_prob`); each expert is a SwiGLU MLP.

Tensor parallelism splits every expert's intermediate dimension across the ranks (as vLLM does by default):
each rank runs every expert on its slice, and one all-reduce sums the partial outputs of all experts. The
experts' weights are stacked in two parameters, read from the checkpoint's per-expert tensors
(`mlp.experts.N.gate_proj / up_proj / down_proj`). On CUDA with a quantized checkpoint they stay quantized
and run as grouped Triton GEMMs (StackedExperts, model/kernels/triton_moe.py); otherwise (CPU, unquantized
checkpoints) they run expert by expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minedraft.model.config import ModelConfig
from minedraft.model.layers import _check_shape, _load_rows, _param, current_quantization, linear, replicated_loader
from minedraft.model.parallel import TensorParallel
from minedraft.model.quantization import QuantConfig, QuantizedWeight
from minedraft.model.tensor_slice import TensorSlice


class Router(nn.Module):
    """The gate: one logit per expert, replicated on every rank (checkpoint name `mlp.gate.weight`)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = _param((num_experts, hidden), replicated_loader)


class StackedExperts(nn.Module):
    """Every expert's gate/up projection in `w13` [experts, 2 x local, hidden] and down projection in `w2`
    [experts, hidden, local], local = this rank's share of the intermediate size.

    Built inside quantized_linears (CUDA with triton), each stack keeps the checkpoint's storage instead
    (`quantized["w13"]`, `quantized["w2"]`: FP8 codes and block scales, or AWQ's packed words, zeros and
    scales, one weight per expert; the parameter stays empty), and the forward runs the grouped Triton
    GEMMs (model/kernels/triton_moe.py) on whatever each stack holds. A stack whose tensor-parallel slice does not
    line up with the scale blocks or packing is dequantized at load, and says so in `fallbacks`."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TensorParallel,
                 batch_invariant: bool) -> None:
        super().__init__()
        if intermediate % tp.size:
            raise ValueError(f"moe_intermediate_size {intermediate} is not divisible by tensor-parallel size {tp.size}")
        self.tp, self.batch_invariant, self.local = tp, batch_invariant, intermediate // tp.size
        self.num_experts = num_experts
        quant = current_quantization()
        self.grouped = quant is not None
        self.quantized: dict[str, QuantizedWeight] = {}
        self.fallbacks: list[str] = []  # why a stack was dequantized at load (the runner logs it)
        self.w13 = self._stack("w13", (2 * self.local, hidden), quant, self._load_gate_up)
        self.w13.checkpoint_parts = [  # type: ignore[attr-defined]
            (f"{e}.{name}.weight", (e, slot))
            for e in range(num_experts)
            for slot, name in enumerate(("gate_proj", "up_proj"))
        ]
        self.w2 = self._stack("w2", (hidden, self.local), quant, self._load_down)
        self.w2.checkpoint_parts = [(f"{e}.down_proj.weight", e) for e in range(num_experts)]  # type: ignore[attr-defined]

    def _stack(self, name: str, shape: tuple[int, int], quant: QuantConfig | None, loader) -> nn.Parameter:
        """The stack's parameter: dense, or empty beside quantized storage (filled only on a fallback)."""
        if quant is None or not QuantizedWeight.can_hold(quant, *shape):
            return _param((self.num_experts, *shape), loader)
        self.quantized[name] = QuantizedWeight(quant, *shape, torch.get_default_dtype(), experts=self.num_experts)
        return _param((0,), loader)

    def _load_gate_up(self, param: nn.Parameter, source: TensorSlice, shard_id: object = None) -> None:
        expert, slot = shard_id  # type: ignore[misc]
        self._place("w13", source, expert, 0, slot * self.local)

    def _load_down(self, param: nn.Parameter, source: TensorSlice, shard_id: object = None) -> None:
        self._place("w2", source, shard_id, 1, 0)  # type: ignore[arg-type]

    def _place(self, name: str, source: TensorSlice, expert: int, dim: int, offset: int) -> None:
        """This rank's slice of `source` along `dim` into expert `expert` of stack `name`, at `offset`."""
        full, start = self.local * self.tp.size, self.tp.rank * self.local
        stored = self.quantized.get(name)
        if stored is not None:
            if stored.can_place(source, dim, offset, self.local, full, start):
                _check_shape(source, tuple(full if d == dim else n for d, n in enumerate(stored.shape)))
                stored.place(source, dim, offset, self.local, start, expert)  # type: ignore[arg-type]
                return
            self._dequantize(name, dim, start)
        dst = getattr(self, name).data[expert].narrow(dim, offset, self.local)
        _load_rows(dst, source, full, start, dim)

    def _dequantize(self, name: str, dim: int, start: int) -> None:
        """Hold stack `name` densely from now on (the experts loaded so far included)."""
        stored = self.quantized.pop(name)
        getattr(self, name).data = stored.dequantize()
        self.fallbacks.append(f"MoE experts' {name}: rank {self.tp.rank}'s slice ({self.local} "
                              f"{'rows' if dim == 0 else 'columns'} from {start}) or the checkpoint's tensors do "
                              f"not line up with {stored.quant.describe()} storage: dequantized at load")  # fmt: skip

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over each token's experts ([tokens, k] ids and weights)."""
        if self.grouped:
            from minedraft.model.kernels.triton_moe import fused_experts

            return fused_experts(x, experts, weights, self.quantized.get("w13", self.w13),
                                 self.quantized.get("w2", self.w2), self.num_experts, self.batch_invariant)  # fmt: skip
        return self._expert_by_expert(x, experts, weights)

    def _expert_by_expert(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Expert by expert in ascending order: a token's result depends on its own experts only, whatever
        else is in the batch."""
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
