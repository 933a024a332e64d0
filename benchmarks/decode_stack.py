"""A decode step's forward as one C call (model/kernels/cpu_stack.py) against the same model's layers one by one,
on CPU.

    python benchmarks/decode_stack.py                 # the bundled target and draft, 1 and 2 threads
    python benchmarks/decode_stack.py --rounds 9 --threads 1
    python benchmarks/decode_stack.py --models smollm2-135m-instruct --threads 2 --repeats 5   # the real model

One runner per model with the C fused kernels (the default mode); each round times its forward with the stack and
without (`model.model.decode_stack` set aside) on the same steps, in turns, so that the two see the same minute:
decode steps and verification windows of 1, 8 and 32 sequences over a 200-token context, and prompts (from
position 0) of one to four sequences. Reported: each form's
median milliseconds per forward and the median of the per-round ratios (stack / layers), with the steps' rows:
the stack runs steps of up to `cpu_stack.MAX_ROWS` rows, larger ones run the layers either way (timed anyway,
with the limit lifted, to show where torch's GEMMs pay). Not part of CI: it times, it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minedraft.config import BUNDLED_DRAFT, BUNDLED_TARGET
from minedraft.model.checkpoint import resolve_checkpoint
from minedraft.model.kernels import cpu_stack
from minedraft.model.runner import ModelRunner, SeqInput

CONTEXT = 200  # tokens each sequence holds before the timed steps
SHAPES = [(1, 1), (1, 5), (8, 1), (8, 5), (32, 1), (32, 2), (32, 5)]  # (sequences, tokens each)
PROMPTS = [(1, 64), (1, 128), (1, 192), (1, 256), (4, 48)]  # (sequences, prompt tokens each), read from position 0


def _runner(path) -> ModelRunner:
    runner = ModelRunner(path, max_seq_len=CONTEXT + 64, num_slots=32 + 4, dtype="auto")
    if not runner.decode_stack:
        raise SystemExit(f"{path.name}: the one-call stack does not run here (see the log)")
    for slot in range(32):
        runner.allocate_slot()
        runner.forward([SeqInput(slot, [(7 * slot + i) % 4000 + 3 for i in range(CONTEXT)], 0)])
    for _ in range(4):  # slots 32.. hold the prompts, each read again from position 0
        runner.allocate_slot()
    return runner


def _steps(seqs: int, tokens: int, prompt: bool) -> list[SeqInput]:
    if prompt:
        return [SeqInput(32 + s, [(5 * s + i) % 4000 + 3 for i in range(tokens)], 0) for s in range(seqs)]
    return [SeqInput(s, [5] * tokens, CONTEXT, num_logits=tokens) for s in range(seqs)]


def _seconds(runner: ModelRunner, steps: list[SeqInput], repeats: int) -> float:
    """Per forward: the same step again and again (each rewrites the same slots of the cache)."""
    runner.forward(steps)
    start = time.perf_counter()
    for _ in range(repeats):
        runner.forward(steps)
    return (time.perf_counter() - start) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    parser.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    parser.add_argument("--repeats", type=int, default=30, help="forwards timed per form, shape and round")
    parser.add_argument("--models", default=f"{BUNDLED_TARGET},{BUNDLED_DRAFT}",
                        help="comma-separated folders, GGUF files or packaged names (dtype auto, as served)")
    args = parser.parse_args()
    cpu_stack.MAX_ROWS = 1 << 20  # every shape through the stack, to show where it stops paying
    print("| model | threads | sequences x tokens | rows | layers one by one | one call | one call / layers |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        path = resolve_checkpoint(model)
        name = path.stem if path.is_file() else path.name
        runner = _runner(path)
        stack = runner.model.model.decode_stack
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for (seqs, tokens), prompt in [(shape, False) for shape in SHAPES] + [(shape, True) for shape in PROMPTS]:
                steps = _steps(seqs, tokens, prompt)
                times: dict[str, list[float]] = {"layers": [], "stack": []}
                for _ in range(args.rounds):
                    for form in ("layers", "stack"):
                        runner.model.model.decode_stack = stack if form == "stack" else None
                        times[form].append(_seconds(runner, steps, args.repeats))
                ratio = statistics.median(s / layer for s, layer in zip(times["stack"], times["layers"]))
                layers_ms, stack_ms = (statistics.median(times[f]) * 1e3 for f in ("layers", "stack"))
                shape = f"{seqs} x {tokens}" + (" prompt" if prompt else "")
                print(f"| {name} | {threads} | {shape} | {seqs * tokens} | {layers_ms:.2f} ms | "
                      f"{stack_ms:.2f} ms | {ratio:.2f}x |", flush=True)  # fmt: skip
            runner.model.model.decode_stack = stack
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
