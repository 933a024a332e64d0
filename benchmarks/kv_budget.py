"""Paged KV cache and chunked prefill, measured offline on the bundled model pair.

    python benchmarks/kv_budget.py capacity   # requests held at once under a KV budget
    python benchmarks/kv_budget.py chunked    # short requests' TTFT and ITL while long prompts arrive

`capacity` runs 64 bundled prompts (64 output tokens each) under --kv-mib of KV cache per worker and
reports the most requests running at once, preemptions and throughput; the slot cache this replaced
held budget / (max_model_len x bytes per token) requests whatever their length.
`chunked` keeps 16 short requests decoding, lets --long prompts of --long-tokens tokens arrive after a
few steps, and reports the short requests' inter-token latency (median and worst gap) and the TTFT of
short requests that arrive right after the long ones, for each --budgets value of max_num_batched_tokens
(a budget above the longest prompt prefills it in one forward, as before chunked prefill).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from minedraft.bench.prompts import load_prompts
from minedraft.config import EngineConfig
from minedraft.engine.engine import LLMEngine
from minedraft.sampling.params import SamplingParams

SPECS = {"ar": None, "minedraft": {"num_speculative_tokens": 4, "is_parallel": True}}


def _engine(mode: str, **kwargs) -> LLMEngine:
    return LLMEngine.local(EngineConfig(device="cpu", speculative_config=SPECS[mode], **kwargs))


def capacity(args: argparse.Namespace) -> None:
    print("| mode | KV budget | blocks x size | most running | preemptions | tok/s | slot cache held |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        engine = _engine(mode, max_num_seqs=32 if mode == "ar" else 16, block_size=args.block_size,
                         kv_cache_memory_bytes=args.kv_mib << 20)
        prompts = [engine.tokenizer.encode(p) for p in load_prompts(limit=args.num_prompts)]
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(prompt, params)
        peak, start = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.pipeline.batches.num_running)
        seconds = time.perf_counter() - start
        cache = engine.executor.verifier.runner.kv_cache
        per_token = sum(t[:, 0].numel() * t.element_size() for t in (*cache.k, *cache.v)) // cache.block_size
        slots = (args.kv_mib << 20) // (engine.max_model_len * per_token)
        budget = engine.pipeline.batches.budget
        print(f"| {mode} | {args.kv_mib} MiB | {budget.num_blocks} x {budget.block_size} | {peak} | "
              f"{engine.num_preemptions} | {len(prompts) * 64 / seconds:.0f} | {slots} |")
        engine.executor.close()


def chunked(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    print("| mode | max_num_batched_tokens | short ITL p50 ms | short ITL max ms | TTFT after long ms | wall s |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for budget in (int(b) for b in args.budgets.split(",")):
            engine = _engine(mode, max_num_seqs=16, max_num_batched_tokens=budget)
            vocab = engine.tokenizer.vocab_size
            prompts = [engine.tokenizer.encode(p) for p in load_prompts(limit=24)]
            short = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
            decoding = [engine.add_request(p, short) for p in prompts[:12]]
            stamps: dict[str, list[float]] = {r.request_id: [] for r in decoding}
            late, step, start = [], 0, time.perf_counter()
            while engine.has_unfinished():
                if step == 8:  # long prompts arrive while the short ones decode; short ones right behind them
                    for _ in range(args.long):
                        long_prompt = [rng.randrange(3, vocab) for _ in range(args.long_tokens)]
                        engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                    late = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=8)) for p in prompts[12:]]
                for request in engine.step():
                    if request.request_id in stamps:
                        stamps[request.request_id].append(time.perf_counter())
                step += 1
            wall = time.perf_counter() - start
            gaps = [b - a for times in stamps.values() for a, b in zip(times, times[1:])]
            ttft = statistics.median(r.first_token_time - r.arrival_time for r in late) if late else 0.0
            print(f"| {mode} | {budget} | {statistics.median(gaps) * 1e3:.1f} | {max(gaps) * 1e3:.0f} | "
                  f"{ttft * 1e3:.0f} | {wall:.1f} |")
            engine.executor.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["capacity", "chunked"])
    parser.add_argument("--modes", default="ar,minedraft")
    parser.add_argument("--kv-mib", type=int, default=24, help="capacity: KV budget per worker, MiB")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--budgets", default="4096,256", help="chunked: max_num_batched_tokens values")
    parser.add_argument("--long", type=int, default=3, help="chunked: long prompts")
    parser.add_argument("--long-tokens", type=int, default=900, help="chunked: tokens per long prompt")
    args = parser.parse_args()
    capacity(args) if args.what == "capacity" else chunked(args)


if __name__ == "__main__":
    main()
