"""Adaptive speculation across load: ours (adaptive, and fixed ar / sd / MineDraft) and vLLM's CPU build,
side by side at each number of requests in flight.

    python benchmarks/load_sweep.py                                   # 1, 4, 16, 32, 64 in flight
    python benchmarks/load_sweep.py --loads 1,16 --out /tmp/sweep     # a quick look

At each load every engine runs in a process of its own (minedraft.bench.engines, as in benchmarks/vs_vllm.py:
loaded once, a warm-up, then interleaved rounds, medians reported; MineDraft's two batches from 2 in flight
on) on the first 2 x load bundled held-out prompts (at least 8), 64 greedy output tokens each. Writes OUT.json
(every round), OUT.md (the table) and OUT.png (tok/s against load; needs matplotlib, `pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from minedraft.bench.engines import ENGINES as ALL_ENGINES
from minedraft.bench.engines import LOG_DIR, EngineSettings, compare
from minedraft.bench.vllm_env import VENV

ENGINES = "vllm-ar,vllm-sd,vllm-sd-k2,ar,sd-k2-fixed,sd-fixed,minedraft-fixed,sd,minedraft"


def measure(load: int, args: argparse.Namespace) -> dict[str, dict]:
    """{engine: {tok_s, mean_accepted_length, mean_k, differing}} at one load (MineDraft, two batches, from 2)."""
    engines = [n for n in args.engines.split(",") if load >= 2 or not n.startswith("minedraft")]
    settings = EngineSettings(num_prompts=max(8, min(160, 2 * load)), max_tokens=args.max_tokens, max_num_seqs=load,
                              k=args.k, device="cpu", warmup=1)
    engines = compare(engines, settings, rounds=args.rounds, settle_s=args.settle, venv=args.venv,
                      log_dir=args.log_dir)  # fmt: skip
    reference = next((e for e in engines if e.name == "ar"), None)
    return {
        e.name: {
            "tok_s": e.rounds[0]["output_tokens"] / e.seconds,
            "mean_accepted_length": e.rounds[-1]["mean_accepted_length"],
            "mean_k": e.rounds[-1].get("mean_k"),
            "differing_from_our_ar": sum(a != b for a, b in zip(e.tokens, reference.tokens)) if reference else None,
            "rounds": [r["seconds"] for r in e.rounds],
        }
        for e in engines
    }


def table(results: dict[int, dict[str, dict]]) -> str:
    """Tokens/s per engine and load, then adaptive's ratio to our best fixed mode and to vLLM's best."""
    loads = sorted(results)
    names = list(dict.fromkeys(name for load in loads for name in results[load]))
    rows = ["| engine | " + " | ".join(f"{n} in flight" for n in loads) + " |", "|---|" + "---|" * len(loads)]
    for name in names:
        cells = []
        for load in loads:
            r = results[load].get(name)
            k = f" (k {r['mean_k']:.1f})" if r and r["mean_k"] is not None else ""
            cells.append(f"{r['tok_s']:.0f}{k}" if r else "-")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    for adaptive in ("sd", "minedraft"):
        if adaptive not in names:
            continue
        for label, pool in (("our best fixed", lambda n: not n.startswith("vllm-") and n not in ("sd", "minedraft")),
                            ("vLLM's best", lambda n: n.startswith("vllm-"))):
            cells = []
            for load in loads:
                best = max((r["tok_s"] for n, r in results[load].items() if pool(n)), default=None)
                ours = results[load].get(adaptive)
                cells.append(f"{ours['tok_s'] / best:.2f}" if best and ours else "-")
            rows.append(f"| {adaptive} (adaptive) / {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(results: dict[int, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted(results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(name for load in loads for name in results[load]):
        style = "--" if name.startswith("vllm-") else ("-" if name in ("sd", "minedraft") else ":")
        points = [(n, results[n][name]["tok_s"]) for n in loads if name in results[n]]
        ax.plot(*zip(*points), style, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(loads, [str(n) for n in loads])
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Greedy decoding of the bundled pair on CPU: adaptive (solid), fixed (dotted), vLLM (dashed)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", default="1,4,16,32,64", help="requests in flight, comma-separated")
    parser.add_argument("--engines", default=ENGINES, help=f"of {','.join(ALL_ENGINES)}")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (adaptive: the most)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--venv", type=Path, default=VENV)
    parser.add_argument("--log-dir", type=Path, default=LOG_DIR)
    parser.add_argument("--out", type=Path, default=Path("load-sweep"), help="writes OUT.json, OUT.md, OUT.png")
    args = parser.parse_args()
    started, results = time.time(), {}
    for load in (int(n) for n in args.loads.split(",")):
        print(f"== {load} in flight", flush=True)
        results[load] = measure(load, args)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))  # kept if a later load fails
    text = (f"Greedy, {args.max_tokens} output tokens per prompt, k <= {args.k}, float32 on CPU, median of "
            f"{args.rounds} interleaved rounds per load ({time.time() - started:.0f} s in all)\n\n{table(results)}\n")
    args.out.with_suffix(".md").write_text(text)
    print("\n" + text)
    try:
        plot(results, args.out.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
