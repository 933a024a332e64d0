"""Served side by side with vLLM: `vllm bench serve --backend openai` against `minedraft up` and `vllm serve`.

    python benchmarks/openai_serve.py                        # first run: creates .venv-vllm (see vs_vllm.py)
    python benchmarks/openai_serve.py --servers minedraft,sd,vllm-sd --rounds 3 --json result.json

Every server is started once (`minedraft.bench.servers`: ours with `minedraft up --http-port`, vLLM with its
OpenAI server), with the same models (the bundled pair), the same draft settings (draft model, k tokens) and
as many requests running at once (MineDraft: two batches of half that).
The same client, vLLM's own serving benchmark (`vllm.benchmarks.serve`, run from the vLLM venv through
its Python entry point), sends the same prompts (the held-out set, as a custom dataset) with the same
settings to each server; the rounds interleave the servers and each one's median round is reported.
Greedy outputs are compared between servers (the benchmark's detailed results carry the texts).
With `--our-client`, `minedraft bench --backend openai` follows vLLM's client in every round with the same
prompts and settings, and a third table sets the two clients' median TTFT, TPOT and ITL side by side (the
two measure the same definitions; on a quiet machine their ratios should stay near 1).
With `--sweep-concurrency` and `--neighbour`, every server also runs each load beside a busy process (a
`while True` loop started for the run), interleaved with its quiet runs, and the table adds each server's
neighbour / quiet and each of ours against the best of vLLM's beside the same neighbour. A sweep warms every
server up at its middle load; with `--warm-every-load` at each load, so that the rounds measure a server that has
run at that load before (our controller tries its shapes at each load it meets first).
A second table says where the servers' CPU went: CPU seconds per 1,000 output tokens of each server
process (Linux, from /proc; ours by role, vLLM's by process name). The client is left out: each of its runs
starts a new Python process that imports vLLM, which costs more CPU than the streaming itself.
With `--workload code-edit` or `quote-context` the prompts are answers that repeat the prompt's text (a function
of our source to rewrite with one small change, a passage of our docs to quote; models/prompts/) and the servers
are those that draft without a draft model (`ngram`, `suffix`, vLLM's and llama-server's lookups) beside plain
decoding: `minedraft.bench.lookup`'s client sends them, since vLLM's cannot send the `prediction` that the servers
named +prediction get with each request, and the tables add the accepted prediction tokens per request.
Not part of CI: it needs the vLLM CPU build (about 1 GB, plus pandas for the benchmark's custom dataset)
and a few minutes of every core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from minedraft.bench import lookup
from minedraft.bench.cpu import tree_cpu_seconds
from minedraft.bench.engines import busy_neighbour
from minedraft.bench.llama_cpp import ensure_llama_server
from minedraft.bench.rounds import interleaved
from minedraft.bench.servers import (
    BUNDLED,
    SERVED_NAME,
    SERVERS,
    ServedModels,
    Server,
    packaged_models,
    start_server,
    wait_healthy,
)
from minedraft.bench.vllm_env import VENV, ensure_pandas, ensure_venv, peer_environment
from minedraft.config import REPO_ROOT

METRICS = [  # (vllm bench serve's result key, column)
    ("output_throughput", "out tok/s"),
    ("request_throughput", "req/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("median_itl_ms", "ITL p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("spec_decode_acceptance_length", "acc len"),  # read by vllm bench from the server's vllm:spec_decode_*
]


def dataset(num_prompts: int, folder: Path, models: ServedModels) -> Path:
    """The models' held-out prompts as vLLM's custom dataset (one {"prompt": ...} per line), a chat model's each
    rendered with its chat template as one user turn (every server then reads the same text)."""
    lines = models.prompts.read_text(encoding="utf-8").splitlines()[:num_prompts]
    prompts = [json.loads(line)["prompt"] for line in lines]
    if models.chat:
        from minedraft.frontends.chat import ChatTemplate

        template = ChatTemplate.from_checkpoint(models.target_hf)
        prompts = [template.render([{"role": "user", "content": p}]) for p in prompts]
    path = folder / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts) + "\n")
    return path


def bench(server: Server, args: argparse.Namespace, vllm_python: str, data: Path, out: Path,
          concurrency: int | None = None, num_prompts: int | None = None) -> dict:
    """One run of vLLM's serving benchmark against `server`; its result JSON."""
    concurrency, num_prompts = concurrency or args.concurrency, num_prompts or args.num_prompts
    result = out / f"{server.name}-c{concurrency}-{time.monotonic_ns()}.json"
    bench_args = [
        "--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
        "--model", SERVED_NAME, "--tokenizer", str(args.models.target_hf),
        "--dataset-name", "custom", "--dataset-path", str(data), "--custom-output-len", str(args.max_tokens),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--temperature", "0", "--ignore-eos", "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", result.name,
    ]  # fmt: skip
    code = (
        "import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
        "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
    )
    with open(out / "bench-client.log", "a") as log:
        subprocess.run([vllm_python, "-c", code, *bench_args], check=True, stdout=log, stderr=subprocess.STDOUT,
                       env=peer_environment())  # fmt: skip
    return json.loads(result.read_text())


def bench_ours(server: Server, args: argparse.Namespace, data: Path, out: Path) -> dict:
    """One run of `minedraft bench --backend openai` with vLLM's client's prompts and settings; its result JSON
    (vLLM's keys)."""
    result = out / f"{server.name}-ours-{len(server.ours)}.json"
    command = [
        sys.executable, "-m", "minedraft", "bench", "--backend", "openai", "--base-url", server.url,
        "--served-model-name", SERVED_NAME, "--tokenizer", str(args.models.target_hf), "--dataset", str(data),
        "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens), "--ignore-eos",
        "--concurrency", str(args.concurrency), "--temperature", "0", "--warmup", "0", "--percentiles", "50,99",
        "--json", str(result),
    ]  # fmt: skip
    with open(out / "bench-client.log", "a") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "services")})  # fmt: skip
    return json.loads(result.read_text())


CLIENT_METRICS = [("median_ttft_ms", "TTFT p50 ms"), ("median_tpot_ms", "TPOT p50 ms"), ("median_itl_ms", "ITL p50 ms")]


def client_table(servers: list[Server]) -> str:
    """Per server, each latency's median round by vLLM's client and by ours, and ours / vLLM's."""
    head = "| server | " + " | ".join(f"{column}: vLLM's / ours / ratio" for _, column in CLIENT_METRICS) + " |"
    lines = [head, "|" + "---|" * (len(CLIENT_METRICS) + 1)]
    for server in servers:
        if not server.ours:
            continue
        cells = []
        for key, _ in CLIENT_METRICS:
            theirs, ours = server.median(key), server.median(key, ours=True)
            cells.append(f"{theirs:.1f} / {ours:.1f} / {ours / theirs:.2f}")
        lines.append(f"| {server.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_table(servers: list[Server]) -> str:
    lines = ["| server | CPU s per 1k tokens, by process | all processes |", "|---|---|---|"]
    for server in servers:
        shares = [r["cpu_per_1k_tokens"] for r in server.rounds if "cpu_per_1k_tokens" in r]
        if not shares:
            continue
        labels = sorted({label for share in shares for label in share})
        median = {label: statistics.median(s.get(label, 0.0) for s in shares) for label in labels}
        processes = ", ".join(f"{label} {median[label]:.2f}" for label in labels if median[label] >= 0.005)
        lines.append(f"| {server.name} | {processes} | {sum(median.values()):.2f} |")
    return "\n".join(lines)


def table(servers: list[Server]) -> str:
    head = "| server | " + " | ".join(column for _, column in METRICS) + " | outputs != first server's |"
    lines = [head, "|" + "---|" * (len(METRICS) + 2)]
    reference = servers[0].rounds[0].get("generated_texts") if servers and servers[0].rounds else None
    for server in servers:
        texts = server.rounds[0].get("generated_texts") if server.rounds else None
        differing = "-" if reference is None or texts is None else str(sum(a != b for a, b in zip(reference, texts)))
        cells = [f"{server.median(key):.1f}" for key, _ in METRICS]
        lines.append(f"| {server.name} | " + " | ".join(cells) + f" | {differing} |")
    return "\n".join(lines)


def steps_by_shape(server: Server) -> dict[str, float]:
    """Our server's steps by shape so far (its /metrics); empty for vLLM's."""
    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    prefix = "minedraft:spec_decode_steps_by_shape_total{"
    shapes = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            labels, value = line[len(prefix):].split("}")
            shapes[labels.split('"')[1]] = float(value)
    return shapes


def sweep(servers: list[Server], args: argparse.Namespace, vllm_python: str, data: Path, work: Path) -> None:
    """Each round runs every server at every load (requests in flight), in turn; 2 x load prompts a run (at
    least 8), so that every load keeps its requests in flight for a while."""
    loads = [int(c) for c in args.sweep_concurrency.split(",")]
    # Warm-up, not measured: at the middle load (compilation, the controller's first fits), or with
    # --warm-every-load at each load, where our controller first tries its shapes (a long-running server's state).
    middle = [(loads[len(loads) // 2], None)]  # at the run size of --num-prompts
    warm_ups = [(load, max(8, 2 * load)) for load in loads] if args.warm_every_load else middle
    for load, num_prompts in warm_ups:
        for server in servers:
            if not server.crowded:
                bench(server, args, vllm_python, data, work, concurrency=load, num_prompts=num_prompts)

    def at_load(server: Server, load: int) -> Callable[[int], dict]:
        def run(round_index: int) -> dict:
            before = steps_by_shape(server)
            with busy_neighbour(server.crowded):
                result = bench(server, args, vllm_python, data, work, concurrency=load, num_prompts=max(8, 2 * load))
            after = steps_by_shape(server)
            result["steps_by_shape"] = {k: after[k] - before.get(k, 0.0) for k in after}
            if round_index:  # the first round's texts are enough to compare outputs
                result.pop("generated_texts", None)
            server.by_load.setdefault(load, []).append(result)
            return result

        return run

    def report(round_index: int, key: tuple[int, str], result: dict) -> None:
        print(f"round {round_index + 1} load {key[0]} {key[1]}: {result['output_throughput']:.0f} tok/s "
              f"{result['steps_by_shape'] or ''}", flush=True)  # fmt: skip

    runs = {(load, server.name): at_load(server, load) for load in loads for server in servers}
    interleaved(runs, args.rounds, settle_s=1, report=report)


def measured(server: Server, args: argparse.Namespace, vllm_python: str, data: Path,
             work: Path) -> Callable[[int], dict]:
    """One round against `server`: vLLM's client, the server's CPU seconds per 1,000 output tokens meanwhile,
    and with --our-client `minedraft bench` after it; kept in `server.rounds` and `server.ours`."""

    def run(_round: int) -> dict:
        before = tree_cpu_seconds(server.process.pid)
        result = bench(server, args, vllm_python, data, work)
        after, per_1k = tree_cpu_seconds(server.process.pid), 1000 / max(1, result["total_output_tokens"])
        result["cpu_per_1k_tokens"] = {name: (after[name] - before.get(name, 0.0)) * per_1k for name in after}
        server.rounds.append(result)
        if args.our_client:
            server.ours.append(bench_ours(server, args, data, work))
        return result

    return run


def sweep_table(servers: list[Server]) -> str:
    """Median output tok/s per server and load, [min, max] over the rounds; then the default against the best
    of our fixed shapes and of vLLM's servers; then our servers' steps by shape (share, median round)."""
    loads = sorted({load for s in servers for load in s.by_load})
    median = {(s.name, load): statistics.median(r["output_throughput"] for r in s.by_load[load])
              for s in servers for load in loads}  # fmt: skip
    lines = ["| server | " + " | ".join(f"{load} in flight" for load in loads) + " |", "|---" * (len(loads) + 1) + "|"]
    for s in servers:
        cells = []
        for load in loads:
            values = [r["output_throughput"] for r in s.by_load[load]]
            cells.append(f"{median[s.name, load]:.0f} [{min(values):.0f}-{max(values):.0f}]")
        lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
    names = [s.name for s in servers]
    fixed = [n for n in names if n.endswith("-fixed") or n == "ar"]
    theirs = [n for n in names if _is_peer(n) and not n.endswith("+neighbour")]
    for default in [n for n in names if n in ("minedraft", "sd")]:
        for label, group in ((f"{default} / our ar", [n for n in names if n == "ar"]),
                             (f"{default} / best of ours fixed", fixed), (f"{default} / best peer", theirs)):
            if group:
                ratios = [median[default, load] / max(median[n, load] for n in group) for load in loads]
                lines.append(f"| {label} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    lines += _neighbour_rows(median, names, loads)
    lines += _starts_rows(median, names, loads)
    lines += _same_texts_rows(servers, loads)
    lines += ["", "TPOT p50 ms (median round):", ""]
    lines += ["| server | " + " | ".join(f"{load} in flight" for load in loads) + " |", "|---" * (len(loads) + 1) + "|"]
    for s in servers:
        cells = []
        for load in loads:
            tpot = [r["median_tpot_ms"] for r in s.by_load[load] if r.get("median_tpot_ms") is not None]
            cells.append(f"{statistics.median(tpot):.1f}" if tpot else "-")
        lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
    lines += ["", "Steps by shape (share of the median round's steps):", ""]
    lines += ["| server | " + " | ".join(f"{load} in flight" for load in loads) + " |", "|---" * (len(loads) + 1) + "|"]
    for s in servers:
        if not any(r.get("steps_by_shape") for rs in s.by_load.values() for r in rs):
            continue
        cells = []
        for load in loads:
            shapes: dict[str, float] = {}
            for r in s.by_load[load]:
                for k, v in r.get("steps_by_shape", {}).items():
                    shapes[k] = shapes.get(k, 0.0) + v
            total = sum(shapes.values()) or 1.0
            cells.append(" ".join(f"{k} {v / total:.0%}" for k, v in sorted(shapes.items()) if v))
        lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _same_texts_rows(servers: list[Server], loads: list[int]) -> list[str]:
    """Per server and load, how many of its first round's greedy texts equal our ar server's (where one ran)."""
    reference = next((s for s in servers if s.name in ("ar", "ar#1")), None)
    if reference is None:
        return []
    lines = ["", f"Greedy texts equal to {reference.name}'s (first round):", "",
             "| server | " + " | ".join(f"{load} in flight" for load in loads) + " |", "|---" * (len(loads) + 1) + "|"]
    for s in servers:
        cells = []
        for load in loads:
            ours, theirs = (x.by_load[load][0].get("generated_texts") or [] for x in (reference, s))
            cells.append(f"{sum(a == b for a, b in zip(ours, theirs))}/{len(theirs)}" if theirs else "-")
        lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
    return lines


def _is_peer(name: str) -> bool:
    return name.startswith(("vllm", "llama"))


def _starts_rows(median: dict[tuple[str, int], float], names: list[str], loads: list[int]) -> list[str]:
    """With --starts: per server, the largest distance of one start's median from the median of its starts."""
    starts: dict[str, list[str]] = {}
    for name in names:
        if "#" in name:
            starts.setdefault(name.split("#")[0], []).append(name)
    lines = []
    for base, group in starts.items():
        cells = []
        for load in loads:
            values = [median[n, load] for n in group]
            middle = statistics.median(values)
            cells.append(f"{max(abs(v / middle - 1) for v in values):.0%} of {middle:.0f}")
        lines.append(f"| {base}: {len(group)} starts, largest distance from their median | " + " | ".join(cells) + " |")
    return lines


def _neighbour_rows(median: dict[tuple[str, int], float], names: list[str], loads: list[int]) -> list[str]:
    """With --neighbour: each server beside the busy process against itself quiet, and each of ours there against
    the best of vLLM's there."""
    crowded = [n for n in names if n.endswith("+neighbour")]
    theirs = [n for n in crowded if _is_peer(n)]
    lines = []
    for name in crowded:
        quiet = name.removesuffix("+neighbour")
        ratios = [median[name, load] / median[quiet, load] for load in loads]
        lines.append(f"| {quiet}: neighbour / quiet | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    for name in crowded:
        if theirs and not _is_peer(name):
            ratios = [median[name, load] / max(median[n, load] for n in theirs) for load in loads]
            lines.append(f"| {name} / best peer there | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    return lines


def sweep_plot(servers: list[Server], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in servers:
        loads = sorted(s.by_load)
        med = [statistics.median(r["output_throughput"] for r in s.by_load[load]) for load in loads]
        low = [min(r["output_throughput"] for r in s.by_load[load]) for load in loads]
        high = [max(r["output_throughput"] for r in s.by_load[load]) for load in loads]
        style = "--" if _is_peer(s.name) else "-"
        ax.plot(loads, med, style, marker="o", label=s.name, linewidth=2.5 if s.name == "minedraft" else 1.2)
        ax.fill_between(loads, low, high, alpha=0.12)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("output tokens / s (median round, band: min-max)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def start_and_wait(servers: list[Server], timeout: float, work: Path) -> list[Server]:
    """The servers that became healthy; each that exited or timed out is stopped and named, with its log's last
    lines, and the run goes on without it (a method a server does not know fails its start)."""
    healthy = []
    for server in servers:
        try:
            wait_healthy(server, timeout, work)
            healthy.append(server)
        except SystemExit as exc:
            server.stop()
            log = work / f"{server.name}.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-8:] if log.exists() else []
            print(f"error: server {server.name} failed to start: {exc}", *("    " + line for line in tail),
                  sep="\n", file=sys.stderr, flush=True)  # fmt: skip
    return healthy


def lookup_sweep(servers: list[Server], args: argparse.Namespace, requests: list[lookup.LookupRequest]) -> None:
    """The lookup workload's rounds: every server at every load, interleaved, each (round, load) on prompts of its
    own (lookup.windows), the same for every server; one warm-up run per server first. Servers named +prediction
    are sent each request's prediction. A run with failed requests is kept and reported (its first error)."""
    loads = [int(c) for c in args.sweep_concurrency.split(",")]
    sizes = [args.num_prompts or max(4, 2 * load) for load in loads]
    warm_up, spans = lookup.windows(len(requests), sizes, args.rounds, warm_up=2)

    def once(server: Server, load: int, indices: list[int]) -> dict:
        return lookup.run(server.url, [requests[i] for i in indices], concurrency=load, model=SERVED_NAME,
                          send_prediction=server.name.split("#")[0].endswith(lookup.PREDICTED),
                          ignore_eos=args.ignore_eos)  # fmt: skip

    for server in servers:
        warm = once(server, 2, warm_up)
        if warm["failed"]:
            print(f"error: {server.name}: {warm['failed']} of the warm-up's requests failed: {warm['first_error']}",
                  file=sys.stderr, flush=True)  # fmt: skip

    def at_load(server: Server, j: int) -> Callable[[int], dict]:
        def run(round_index: int) -> dict:
            before = steps_by_shape(server)
            result = once(server, loads[j], spans[round_index, j])
            after = steps_by_shape(server)
            result["steps_by_shape"] = {k: after[k] - before.get(k, 0.0) for k in after}
            server.by_load.setdefault(loads[j], []).append(result)
            return result

        return run

    def report(round_index: int, key: tuple[int, str], result: dict) -> None:
        accepted = [a for a in result["accepted_prediction_tokens"] if a is not None]
        extra = f", accepted prediction tokens {sum(accepted)}" if accepted else ""
        failed = f", {result['failed']} failed: {result['first_error']}" if result["failed"] else ""
        print(f"round {round_index + 1} load {key[0]} {key[1]}: {result['output_throughput']:.0f} tok/s{extra}{failed}",
              flush=True)  # fmt: skip

    runs = {(load, server.name): at_load(server, j) for j, load in enumerate(loads) for server in servers}
    interleaved(runs, args.rounds, settle_s=1, report=report)


def _family_ar(name: str) -> str:
    """The plain decoding server of `name`'s kind: ours `ar`, vLLM's `vllm-ar`, llama-server's on the bf16 file."""
    if name.startswith("vllm"):
        return "vllm-ar"
    return "llama-ar-bf16" if name.startswith("llama") else "ar"


def lookup_table(servers: list[Server]) -> str:
    """The lookup workload's tables: output tok/s per server and load (median round [min-max]); each drafting
    server against the plain decoding of its own kind and each of ours against the best peer; TTFT and TPOT;
    the accepted and rejected prediction tokens per request; greedy texts equal to our ar's; steps by shape."""
    loads = sorted({load for s in servers for load in s.by_load})
    names = [s.name for s in servers]
    head = ["| server | " + " | ".join(f"{load} in flight" for load in loads) + " |", "|---" * (len(loads) + 1) + "|"]

    def rounds_of(s: Server, load: int) -> list[dict]:
        return s.by_load.get(load, [])

    def median_of(s: Server, load: int, key: str) -> float | None:
        values = [r[key] for r in rounds_of(s, load) if r.get(key) is not None and not r.get("failed")]
        return statistics.median(values) if values else None

    median = {(s.name, load): median_of(s, load, "output_throughput") for s in servers for load in loads}
    lines = ["Output tok/s (median round [min-max]):", "", *head]
    for s in servers:
        cells = []
        for load in loads:
            done = [r["output_throughput"] for r in rounds_of(s, load) if not r.get("failed")]
            failed = sum(r.get("failed", 0) for r in rounds_of(s, load))
            cell = f"{median[s.name, load]:.0f} [{min(done):.0f}-{max(done):.0f}]" if done else "-"
            cells.append(cell + (f" ({failed} requests failed)" if failed else ""))
        lines.append(f"| {s.name} | " + " | ".join(cells) + " |")

    def ratio_row(label: str, name: str, group: list[str]) -> str | None:
        cells = []
        for load in loads:
            best = max((median[n, load] for n in group if median[n, load]), default=None)
            cells.append(f"{median[name, load] / best:.2f}x" if best and median[name, load] else "-")
        return f"| {label} | " + " | ".join(cells) + " |" if any(c != "-" for c in cells) else None

    peers = [n for n in names if _is_peer(n)]
    for name in names:
        base = _family_ar(name.split("#")[0])
        if name.split("#")[0] != base and base in names:
            lines.append(ratio_row(f"{name} / {base}", name, [base]))
    for name in names:
        if not _is_peer(name) and peers:
            lines.append(ratio_row(f"{name} / best peer", name, peers))
    lines = [line for line in lines if line is not None]
    for key, title in (("median_ttft_ms", "TTFT p50 ms"), ("median_tpot_ms", "TPOT p50 ms")):
        lines += ["", f"{title} (median round):", "", *head]
        for s in servers:
            cells = [f"{v:.1f}" if (v := median_of(s, load, key)) is not None else "-" for load in loads]
            lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
    predicted = [s for s in servers if any(a is not None for rs in s.by_load.values() for r in rs
                                           for a in r.get("accepted_prediction_tokens", []))]  # fmt: skip
    if predicted:
        lines += ["", "Prediction tokens per request, every round: accepted mean [min-max] / rejected mean "
                  "(the servers' usage.completion_tokens_details; share of output tokens accepted):", "", *head]
        for s in predicted:
            cells = []
            for load in loads:
                pairs = [(a, rej or 0, n) for r in rounds_of(s, load) for a, rej, n in
                         zip(r["accepted_prediction_tokens"], r["rejected_prediction_tokens"], r["output_lens"])
                         if a is not None]  # fmt: skip
                if not pairs:
                    cells.append("-")
                    continue
                accepted = [a for a, _, _ in pairs]
                share = sum(accepted) / max(1, sum(n for _, _, n in pairs))
                cells.append(f"{statistics.mean(accepted):.0f} [{min(accepted)}-{max(accepted)}] / "
                             f"{statistics.mean(rej for _, rej, _ in pairs):.0f} ({share:.0%})")  # fmt: skip
            lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
    lines += _same_texts_rows(servers, loads)
    shaped = [s for s in servers if any(r.get("steps_by_shape") for rs in s.by_load.values() for r in rs)]
    if shaped:
        lines += ["", "Steps by shape (share of every round's steps):", "", *head]
        for s in shaped:
            cells = []
            for load in loads:
                shapes: dict[str, float] = {}
                for r in rounds_of(s, load):
                    for k, v in r.get("steps_by_shape", {}).items():
                        shapes[k] = shapes.get(k, 0.0) + v
                total = sum(shapes.values()) or 1.0
                cells.append(" ".join(f"{k} {v / total:.0%}" for k, v in sorted(shapes.items()) if v) or "-")
            lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_sweep(path: Path, plot: Path | None) -> int:
    """The tables (and the plot) of a sweep's --json file."""
    saved = json.loads(path.read_text())
    if "servers" not in saved:  # a sweep's file before it named its title
        saved = {"title": "Served through vllm bench serve's client", "servers": saved}
    servers = []
    for name, by_load in saved["servers"].items():
        server = Server(name, None, "")  # type: ignore[arg-type]  # nothing runs
        server.by_load = {int(load): rounds for load, rounds in by_load.items()}
        servers.append(server)
    print(lookup_table(servers) if saved.get("workload", "chat") != "chat" else sweep_table(servers))
    if plot:
        sweep_plot(servers, plot, saved["title"])
    return 0


def run_lookup(args: argparse.Namespace, names: list[str], llama_server: Path | None) -> int:
    """`--workload code-edit|quote-context`: every server started (one that fails to start is named and left out),
    the lookup sweep through our client, the tables; 1 if no server started or a run had failed requests."""
    from minedraft.frontends.chat import ChatTemplate
    from minedraft.model.tokenizer import load_tokenizer

    vllm_python = ""
    if any(SERVERS[n][0] == "vllm" for n in names):
        vllm_python = str(ensure_venv(args.venv))
    template = ChatTemplate.from_checkpoint(args.models.target_hf) if args.models.chat else None
    requests = lookup.load_workload(args.workload, template=template, tokenizer=load_tokenizer(args.models.target_hf),
                                    max_tokens=args.max_tokens or 512)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="openai-serve-"))
    print(f"logs and results: {work}", flush=True)
    labels = [(n, f"{n}#{i + 1}" if args.starts > 1 else n) for n in names for i in range(args.starts)]
    started = [start_server(name, k=args.k, max_num_seqs=args.max_num_seqs, vllm_python=vllm_python, logs=work,
                            models=args.models, llama_server=llama_server, max_model_len=args.max_model_len,
                            label=label) for name, label in labels]  # fmt: skip
    try:
        servers = start_and_wait(started, args.startup_timeout, work)
        if not servers:
            print("error: no server started", file=sys.stderr)
            return 1
        lookup_sweep(servers, args, requests)
    finally:
        for server in started:
            server.stop()
    title = (f"{args.workload} through minedraft's client, {Path(args.models.ours).name}, greedy, at most "
             f"{args.max_tokens or 512} tokens, k = {args.k}")  # fmt: skip
    print(f"\n{title}\n")
    print(lookup_table(servers))
    if args.plot:
        sweep_plot(servers, args.plot, title)
    if args.json:
        by_load = {s.name: s.by_load for s in servers}
        args.json.write_text(json.dumps({"title": title, "workload": args.workload, "servers": by_load}, indent=1))
    failed = sum(r.get("failed", 0) for s in servers for rs in s.by_load.values() for r in rs)
    return 1 if failed or len(servers) < len(started) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="vllm-sd,sd,minedraft", help=f"comma-separated, of {','.join(SERVERS)}")
    parser.add_argument("--model", default="bundled",
                        help="bundled (the bundled pair) or a packaged model's name (smollm2-135m-instruct: served "
                             "with its shipped draft; llama-* servers need it)")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=2048, help="context per request of a packaged model")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens of every speculative server")
    parser.add_argument("--max-num-seqs", type=int, default=32,
                        help="requests running at once; MineDraft runs them as two batches of half this")  # fmt: skip
    parser.add_argument("--workload", choices=["chat", *lookup.WORKLOADS], default="chat",
                        help="chat: the held-out prompts through vllm bench serve's client (EOS ignored); code-edit, "
                             "quote-context: answers that repeat the prompt's text (models/prompts/), through our "
                             "client, which sends the servers named +prediction each request's prediction; a "
                             "sweep of --sweep-concurrency (default 1,8), 2 x load prompts a run (at least 4)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts a run (chat: default 32; lookup workloads: every load's, default 2 x load)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="output tokens per request (chat: default 64, EOS ignored; lookup workloads: at most "
                             "this, default 512, each request its expected answer's tokens + 64, EOS honoured)")
    parser.add_argument("--ignore-eos", action="store_true", help="lookup workloads: ask every request's max tokens")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each server's median is shown")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--venv", type=Path, default=VENV, help="the vLLM venv (created if missing)")
    parser.add_argument("--json", type=Path, default=None, help="also write every round's results")
    parser.add_argument("--sweep-concurrency", default="",
                        help="comma-separated loads (requests in flight), e.g. 1,4,16,32,64: every round runs every "
                             "server at every load; prints a table per load and the shapes our servers chose")
    parser.add_argument("--plot", type=Path, default=None, help="with --sweep-concurrency: a PNG of tok/s by load")
    parser.add_argument("--neighbour", action="store_true",
                        help="with --sweep-concurrency: every server also runs each load beside a busy process (a "
                             "`while True` loop), interleaved with its quiet runs; the table adds neighbour / quiet")
    parser.add_argument("--warm-every-load", action="store_true",
                        help="with --sweep-concurrency: warm every server up at each load, not only the middle one "
                             "(our controller's first tries of its shapes at a load then fall outside the rounds)")
    parser.add_argument("--starts", type=int, default=1,
                        help="with --sweep-concurrency: start each server this many times (NAME#1, NAME#2, ...), "
                             "all measured in the same interleaved rounds; the table adds each one's spread over them")
    parser.add_argument("--report", type=Path, default=None,
                        help="print the tables (and --plot) of a sweep's --json file, running nothing")
    parser.add_argument("--our-client", action="store_true",
                        help="also measure every round with `minedraft bench --backend openai`")  # fmt: skip
    args = parser.parse_args()
    if args.report:
        return report_sweep(args.report, args.plot)
    names = args.servers.split(",")
    unknown = [n for n in names if n not in SERVERS]
    if unknown:
        parser.error(f"unknown servers: {unknown}")
    if args.neighbour and not args.sweep_concurrency:
        parser.error("--neighbour needs --sweep-concurrency")
    llama = any(SERVERS[n][0] == "llama" for n in names)
    if llama and args.model == "bundled":
        parser.error("llama-* servers serve a packaged model's GGUF: pass --model smollm2-135m-instruct")
    predicted = [n for n in names if n.endswith(lookup.PREDICTED)]
    if predicted and args.workload == "chat":
        parser.error(f"{predicted} send predictions: pick a lookup workload (--workload code-edit|quote-context)")
    args.models = BUNDLED if args.model == "bundled" else packaged_models(args.model, llama)
    llama_server = ensure_llama_server() if llama else None
    if args.workload != "chat":
        args.sweep_concurrency = args.sweep_concurrency or "1,8"
        return run_lookup(args, names, llama_server)
    args.num_prompts, args.max_tokens = args.num_prompts or 32, args.max_tokens or 64
    vllm_python = str(ensure_venv(args.venv))
    ensure_pandas(vllm_python)
    work = Path(tempfile.mkdtemp(prefix="openai-serve-"))
    print(f"logs and results: {work}", flush=True)
    most = max([args.num_prompts] + [2 * int(c) for c in args.sweep_concurrency.split(",") if c])
    data = dataset(most, work, args.models)
    labels = [(n, f"{n}#{i + 1}" if args.starts > 1 else n) for n in names for i in range(args.starts)]
    servers = [start_server(name, k=args.k, max_num_seqs=args.max_num_seqs, vllm_python=vllm_python, logs=work,
                            models=args.models, llama_server=llama_server, max_model_len=args.max_model_len,
                            label=label) for name, label in labels]  # fmt: skip
    try:
        for server in servers:
            wait_healthy(server, args.startup_timeout, work)
        if args.sweep_concurrency:
            if args.neighbour:
                servers += [server.beside_a_neighbour() for server in servers]
            sweep(servers, args, vllm_python, data, work)
            title = (f"Served through vllm bench serve's client, {Path(args.models.ours).name}, {args.max_tokens} "
                     f"tokens, greedy, k = {args.k}")  # fmt: skip
            print(sweep_table(servers))
            if args.plot:
                sweep_plot(servers, args.plot, title)
            if args.json:
                by_load = {s.name: s.by_load for s in servers}
                args.json.write_text(json.dumps({"title": title, "servers": by_load}, indent=1) + "\n")
            return 0
        for server in servers:  # warm-up (compilation, first allocations), not measured
            bench(server, args, vllm_python, data, work)

        def report(round_index: int, name: str, result: dict) -> None:
            print(f"round {round_index + 1} {name}: {result['output_throughput']:.0f} tok/s", flush=True)

        # 2 s idle before each run: vLLM's OpenMP threads spin for a while after a run.
        runs = {server.name: measured(server, args, vllm_python, data, work) for server in servers}
        interleaved(runs, args.rounds, settle_s=2, report=report)
    finally:
        for server in servers:
            server.stop()
    print(table(servers))
    print("\nServers' CPU seconds per 1,000 output tokens (median round)\n")
    print(cpu_table(servers))
    if args.our_client:
        print("\nThe same latencies measured by vLLM's client and by `minedraft bench` (median rounds)\n")
        print(client_table(servers))
    if args.json:
        runs = {s.name: {"vllm_client": s.rounds, "minedraft_client": s.ours} if s.ours else s.rounds for s in servers}
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
