"""Chaos run against a `minedraft up` this script starts: `minedraft bench --chaos` (minedraft/bench/chaos.py)
with the stack included. Strict kernels, so greedy output is comparable; `up`'s crash-loop limit raised, since
this run kills on purpose.

    python benchmarks/chaos.py                                   # one group (MineDraft): drafter, verifier
    python benchmarks/chaos.py --engine-groups 2 --targets drafter,verifier,scheduler,gateway

Against a stack already running: `minedraft bench --chaos --target 127.0.0.1:PORT` (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from minedraft.bench.chaos import Chaos, Load, Stack, run_chaos
from minedraft.bench.prompts import load_prompts
from minedraft.config import EngineConfig
from minedraft.model.tokenizer import load_tokenizer
from minedraft.stack.local import free_port


def start_up(args: argparse.Namespace, log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable, "-m", "minedraft", "up", "--port", str(port), "--metrics-port", "0", "--device", "cpu",
        "--batch-invariant", "--speculative-config", args.speculative_config, "--engine-groups",
        str(args.engine_groups), "--max-waiting-requests", str(4 * args.num_prompts), "--log-dir", str(log_dir),
        "--crash-loop-restarts", "1000",
    ]  # fmt: skip
    up = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    if "is serving on" not in up.stdout.readline():
        raise SystemExit(f"minedraft up did not start (service logs: {log_dir})")
    return up, f"127.0.0.1:{port}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--engine-groups", type=int, default=1)
    parser.add_argument("--kill-every", type=float, default=8.0, help="seconds between kills")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of the chaos pass")
    parser.add_argument("--targets", default="drafter,verifier", help="services killed in turn: drafter, "
                        "verifier, scheduler, gateway")  # fmt: skip
    parser.add_argument("--speculative-config", default=json.dumps({"num_speculative_tokens": 4, "is_parallel": True}),
                        help="every group's speculative config (MineDraft by default)")  # fmt: skip
    args = parser.parse_args()

    tokenizer = load_tokenizer(EngineConfig().target_path)
    prompts = [tokenizer.encode(p) for p in load_prompts(limit=args.num_prompts)]
    log_dir = Path(tempfile.mkdtemp(prefix="minedraft-chaos-"))
    print(f"service logs: {log_dir}", flush=True)
    up, address = start_up(args, log_dir)
    try:
        load = Load(address, prompts, args.concurrency, args.max_tokens)
        text, clean = run_chaos(Stack(up.pid), load, Chaos(args.kill_every, args.duration, args.targets.split(",")))
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)
    print(text)
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
