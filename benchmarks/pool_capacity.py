"""How many verifier groups one drafter GPU can serve before drafting becomes the bottleneck: a model, on paper.

    python benchmarks/pool_capacity.py                     # the table of docs/kubernetes.md, as Markdown
    python benchmarks/pool_capacity.py --context 4096 --batch 1 16 64 --k 3 5

No GPU runs here. Two inputs are measured, recorded in docs/performance.md ("The GPU path on an H100",
`benchmarks/gpu_suite.py --steps floor`): an H100 80GB HBM3's copy bandwidth (2.58 TB/s) and how far our
fused decode step of a Llama-3-8B-shaped model (batch 1, 1,024 tokens of context) sits above its HBM floor
(1.19x). Everything else is modelled and said so:

- a forward costs 1.19 x max(bytes it reads / 2.58 TB/s, its FLOPs / 989 TFLOPS) on its GPU, where the
  bytes are the weights it multiplies (bf16; the embedding table only as the LM head) plus the KV cache of
  every sequence at `--context` tokens (bf16), and 989 TFLOPS is the H100 SXM's dense bf16 peak from its
  datasheet (never measured here); the 1.19 of one shape is applied to every shape and batch;
- the target, Qwen3-32B, runs tensor parallel over `--tp` GPUs (4): each reads a quarter of the weights and
  of the KV heads; the all-reduces between them (two per layer) are left out unless `--allreduce-us` gives
  each a cost, which makes the verify step look shorter than it is and so the groups a drafter can serve
  fewer: by default the counts err low;
- MineDraft's overlap (each group's two batches: one verified while the other is drafted): a round is one
  verify forward of `batch` requests x (k + 1) tokens against k sequential draft forwards of a batch
  (method draft_model; PARD would need one). A drafter keeps up with G groups while G groups' drafting of
  a round fits in one verify step: with shared forwards (a pool member batching its groups) k forwards of
  G x batch sequences, one weight read for all; one group at a time, G x k forwards of batch sequences;
- memory: a member holds the draft KV of both batches of every group it serves, in 80 GB x 0.9 (the chart's
  engine.gpuMemoryUtilization) less the draft's weights;
- the model sizes are Qwen3's published configs (hidden size, layers, heads, KV heads, head dim, MLP size,
  vocabulary); the parameter counts they give are printed next to the model cards' own.

GPUs saved per 100 target GPUs: 100 / tp groups, each with a drafter GPU of its own today, against
ceil(groups / G) pool members.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

# Measured (docs/performance.md, "The GPU path on an H100": the fused run of gpu_suite.py --steps floor).
BANDWIDTH = 2.58e12  # bytes/s, copy bandwidth of that H100 80GB HBM3
STEP_OVER_FLOOR = 1.19  # fused decode step / (weight + KV bytes) / bandwidth, Llama-3-8B shape, batch 1, 1,024 ctx
# Modelled: H100 SXM datasheet figures, and the chart's default memory share.
PEAK_FLOPS = 989e12  # dense bf16
HBM_BYTES = 80e9
GPU_MEMORY_UTILIZATION = 0.9
BYTES = 2  # bf16 weights and KV


@dataclass(frozen=True)
class Qwen3:
    """A Qwen3 dense model's shape (its config.json)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool  # the LM head is the embedding table
    card_params: str  # what the model card says
    head_dim: int = 128
    vocab: int = 151936

    def layer_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o; k, v
        norms = 2 * self.hidden + 2 * self.head_dim  # two RMSNorms; q_norm and k_norm
        return attention + 3 * self.hidden * self.intermediate + norms

    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params() + embeddings + self.hidden

    def bytes_read(self, tp: int = 1) -> float:
        """Weight bytes one forward reads on each of `tp` GPUs: every layer and the LM head (the embedding
        table is only looked up, a few rows)."""
        return (self.layers * self.layer_params() + self.vocab * self.hidden) * BYTES / tp

    def kv_bytes_per_token(self, tp: int = 1) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES / tp


TARGET = Qwen3("Qwen3-32B", hidden=5120, layers=64, heads=64, kv_heads=8, intermediate=25600, tied=False,
               card_params="32.8B")  # fmt: skip
DRAFTS = [
    Qwen3("Qwen3-0.6B", hidden=1024, layers=28, heads=16, kv_heads=8, intermediate=3072, tied=True, card_params="0.6B"),
    Qwen3("Qwen3-1.7B", hidden=2048, layers=28, heads=16, kv_heads=8, intermediate=6144, tied=True, card_params="1.7B"),
    Qwen3("Qwen3-4B", hidden=2560, layers=36, heads=32, kv_heads=8, intermediate=9728, tied=True, card_params="4.0B"),
]  # fmt: skip


def forward_seconds(model: Qwen3, sequences: int, tokens_per_sequence: int, context: int, tp: int = 1) -> float:
    """One forward over `sequences` sequences of `context` tokens each, `tokens_per_sequence` new ones each."""
    read = model.bytes_read(tp) + sequences * context * model.kv_bytes_per_token(tp)
    multiplied = (model.layers * model.layer_params() + model.vocab * model.hidden) / tp  # weights per GPU
    flops = 2 * multiplied * sequences * tokens_per_sequence
    return STEP_OVER_FLOOR * max(read / BANDWIDTH, flops / PEAK_FLOPS)


@dataclass(frozen=True)
class Capacity:
    verify_s: float  # one verify step of one group
    draft_s: float  # k draft forwards of one group's batch
    shared: int  # groups one drafter keeps up with, drafting them in shared forwards
    alone: int  # ... drafting one group at a time
    memory: int  # groups whose draft KV (both batches) fits on the drafter GPU

    @property
    def groups(self) -> int:
        return min(self.shared, self.memory)


def capacity(draft: Qwen3, batch: int, k: int, context: int, tp: int, allreduce_s: float = 0.0,
             limit: int = 4096) -> Capacity:
    verify = forward_seconds(TARGET, batch, k + 1, context, tp) + (2 * TARGET.layers * allreduce_s if tp > 1 else 0)
    draft_one = k * forward_seconds(draft, batch, 1, context)
    shared = 0
    while shared < limit and k * forward_seconds(draft, (shared + 1) * batch, 1, context) <= verify:
        shared += 1
    alone = int(verify // draft_one)
    free = HBM_BYTES * GPU_MEMORY_UTILIZATION - draft.bytes_read()
    memory = int(free // (2 * batch * context * draft.kv_bytes_per_token()))
    return Capacity(verify, draft_one, shared, alone, memory)


def table(batches: list[int], ks: list[int], context: int, tp: int, target_gpus: int, allreduce_s: float = 0.0) -> str:
    groups = target_gpus // tp
    allreduce = f"{allreduce_s * 1e6:g} us per all-reduce" if allreduce_s else "all-reduces left out"
    lines = [
        f"Target {TARGET.name} on {tp} GPUs per group ({allreduce}); {context:,} tokens of context per sequence; "
        f"{target_gpus} target GPUs = {groups} groups, each with a drafter GPU of its own today ({groups} drafter "
        "GPUs).",
        "",
        "| draft | batch | k | verify step ms | k draft forwards ms | drafter busy, own GPU | groups per drafter GPU "
        "(shared forwards / one at a time / memory) | pool members | GPUs saved per 100 target GPUs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for draft in DRAFTS:
        for batch in batches:
            for k in ks:
                c = capacity(draft, batch, k, context, tp, allreduce_s)
                # under 1: drafting holds back even a group with a drafter GPU of its own; a pool saves nothing
                members = math.ceil(groups / c.groups) if c.groups else groups
                saved = (groups - members) * 100 / target_gpus
                lines.append(
                    f"| {draft.name} | {batch} | {k} | {c.verify_s * 1e3:.1f} | {c.draft_s * 1e3:.1f} | "
                    f"{min(c.draft_s / c.verify_s, 9.99):.0%} | **{c.groups or '< 1'}** ({c.shared} / {c.alone} / "
                    f"{c.memory}) | {members} | {saved:.0f} |"
                )  # fmt: skip
    return "\n".join(lines)


def inputs() -> str:
    rows = ["| model | parameters (config / model card) | weights read per forward | KV per token |",
            "|---|---|---|---|"]  # fmt: skip
    for model in [TARGET, *DRAFTS]:
        rows.append(
            f"| {model.name} | {model.params() / 1e9:.2f}B / {model.card_params} | {model.bytes_read() / 1e9:.2f} GB | "
            f"{model.kv_bytes_per_token() / 1024:.0f} KiB |"
        )  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="requests per MineDraft batch")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4], help="draft tokens per verification")
    parser.add_argument("--context", type=int, default=1024, help="tokens of context per sequence (KV read)")
    parser.add_argument("--tp", type=int, default=4, help="target GPUs per group")
    parser.add_argument("--target-gpus", type=int, default=100, help="target GPUs in all")
    parser.add_argument("--allreduce-us", type=float, default=0.0,
                        help="microseconds of each of the target's all-reduces (two per layer); 0 = left out")
    parser.add_argument("--inputs", action="store_true", help="also print the models' sizes")
    args = parser.parse_args(argv)
    if args.inputs:
        print(inputs(), end="\n\n")
    print(table(args.batch, args.k, args.context, args.tp, args.target_gpus, args.allreduce_us * 1e-6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
