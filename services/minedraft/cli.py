"""`minedraft ...`: the command-line entry point (also `python -m minedraft`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from minedraft.supervision import watch_parent_from_env

# Decoding modes of `minedraft bench` (minedraft.bench.offline.mode_configs; not imported here: torch).
MODE_NAMES = ("ar", "sd", "pearl", "minedraft", "minedraft+tetris")
OFFLINE_MODES = ",".join(MODE_NAMES)
LAUNCH_MODES = "ar,sd,minedraft"


def _env(flag: str, default: Any = None) -> Any:
    """Default of a flag from its environment variable: --max-num-seqs <- MINEDRAFT_MAX_NUM_SEQS."""
    return os.environ.get("MINEDRAFT_" + flag.lstrip("-").replace("-", "_").upper(), default)


def _add(group, flag: str, default: Any = None, **kwargs) -> None:
    env = "MINEDRAFT_" + flag.lstrip("-").replace("-", "_").upper()
    help_text = kwargs.pop("help", "")
    group.add_argument(flag, default=_env(flag, default), help=f"{help_text} [env {env}]".strip(), **kwargs)


# `minedraft up` is the embedded demo: MineDraft with the bundled pair unless told otherwise.
UP_SPECULATIVE_DEFAULT = '{"num_speculative_tokens": 4, "is_parallel": true}'


def _add_engine_args(parser: argparse.ArgumentParser, speculative_default: str | None = None) -> None:
    """Engine flags, named as vLLM names them; each can also come from a MINEDRAFT_* variable."""
    group = parser.add_argument_group("engine")
    _add(group, "--model", help="target checkpoint folder (HF format); default: bundled target")
    _add(
        group,
        "--speculative-config",
        speculative_default,
        help='MineDraft JSON, e.g. \'{"num_speculative_tokens": 4, "is_parallel": true}\', or null for plain '
        "autoregressive decoding (default: %(default)s)",
    )
    _add(group, "--tensor-parallel-size", 1, type=int, help="target tensor-parallel size")
    _add(group, "--max-num-seqs", 16, type=int, help="requests per batch (MineDraft keeps two)")
    _add(group, "--max-model-len", type=int, help="most tokens per request; default: the model's")
    _add(group, "--dtype", "auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    _add(group, "--device", "auto", help="auto, cpu, cuda, cuda:N")
    _add(group, "--seed", 0, type=int, help="seed of requests that bring none")
    group.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=_env("--batch-invariant", "false").lower() in ("1", "true", "yes"),
        help="strict kernels: every mode token-for-token equal to ar, slower [env MINEDRAFT_BATCH_INVARIANT]",
    )


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "speculative_config": args.speculative_config,
        "tensor_parallel_size": args.tensor_parallel_size,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "batch_invariant": args.batch_invariant,
    }


def _engine_config(args: argparse.Namespace):
    from minedraft.config import EngineConfig

    return EngineConfig(**_engine_kwargs(args))


def _add_dist_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("torch.distributed (drafter <-> verifier tensors)")
    _add(group, "--dist-addr", "127.0.0.1", help="verifier rank 0's address (rendezvous)")
    _add(group, "--dist-port", 29500, type=int, help="rendezvous port on verifier rank 0")
    _add(group, "--dist-backend", "auto", help="auto (NCCL on CUDA, gloo on CPU), nccl, gloo")
    _add(
        group,
        "--idle-reset",
        300.0,
        type=float,
        help="seconds without a step plan after which the worker drops every request's state, as when a new "
        "scheduler connects (0 = never)",
    )
    _add(
        group,
        "--drain-timeout",
        30.0,
        type=float,
        help="on SIGTERM: wait up to this long for the scheduler to stop sending steps (it drains its "
        "requests first), then stop",
    )


def _dist_config(args: argparse.Namespace):
    from minedraft.config import DistributedConfig

    return DistributedConfig(
        master_addr=args.dist_addr,
        master_port=args.dist_port,
        backend=args.dist_backend,
        idle_reset_s=args.idle_reset,
        drain_timeout_s=args.drain_timeout,
        store_host=args.host,  # the rendezvous store listens where the gRPC server does
    )


def _add_listen_args(parser: argparse.ArgumentParser, port: int, host: str = "0.0.0.0") -> None:
    group = parser.add_argument_group("listen")
    _add(group, "--host", host, help="address to listen on")
    _add(group, "--port", port, type=int, help="gRPC port")
    _add(group, "--log-level", "INFO", help="DEBUG, INFO, WARNING")


def _add_sampling_args(parser: argparse.ArgumentParser, temperature: float = 1.0, max_tokens: int = 16) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1, help="-1 = disabled")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace):
    from minedraft.sampling.params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from minedraft.llm import LLM

    params = _sampling_params(args)
    llm = LLM(**_engine_kwargs(args))
    try:
        outputs = llm.generate(args.prompt, params, use_tqdm=not args.json and len(args.prompt) > 1)
    finally:
        llm.close()
    for out in outputs:
        completion = out.outputs[0]
        if args.json:
            stats = out.spec_decode_stats
            record = {
                "prompt": out.prompt,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                "spec_decode_stats": {
                    "num_drafts": stats.num_drafts,
                    "num_draft_tokens": stats.num_draft_tokens,
                    "num_accepted_tokens": stats.num_accepted_tokens,
                    "num_accepted_tokens_per_pos": stats.num_accepted_tokens_per_pos,
                },
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(out.prompt + completion.text)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from minedraft.bench.prompts import load_prompts

    _check_bench_args(args)
    prompts = load_prompts(args.dataset, limit=args.num_prompts)
    if args.offline:
        return _bench_offline(args, prompts)
    try:
        if args.k8s:
            return _bench_k8s(args, prompts)
        return _bench_launch(args, prompts) if args.launch else _bench_target(args, prompts)
    except (RuntimeError, TimeoutError, ConnectionError, LookupError) as exc:  # a server that did not start or answer
        print(f"minedraft bench: {exc}", file=sys.stderr)
        return 1


def _check_bench_args(args: argparse.Namespace) -> None:
    """Errors a user can fix, before loading anything: raised as ValueError, printed by main()."""
    checks = [
        (args.num_prompts >= 1, f"--num-prompts must be >= 1, got {args.num_prompts}"),
        (args.concurrency >= 1, f"--concurrency must be >= 1, got {args.concurrency}"),
        (args.request_rate is None or args.request_rate > 0, f"--request-rate must be > 0, got {args.request_rate}"),
        (args.max_tokens >= 1, f"--max-tokens must be >= 1, got {args.max_tokens}"),
        (args.temperature >= 0, f"--temperature must be >= 0, got {args.temperature}"),
        (args.timeout > 0, f"--timeout must be > 0 seconds, got {args.timeout}"),
        (args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}"),
        (args.k >= 1, f"--k must be >= 1, got {args.k}"),
        (args.repeats >= 1, f"--repeats must be >= 1, got {args.repeats}"),
        (args.target is None or ":" in args.target, f"--target must be host:port, got {args.target!r}"),
        (args.metrics_url is None or args.target is not None or args.k8s, "--metrics-url goes with --target or "
         "--k8s (--launch scrapes each stack it starts)"),
        (args.json is None or not args.offline, "--json is available with --target and --launch"),
        (args.draft_model is None or args.launch, "--draft-model goes with --launch"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _bench_offline(args: argparse.Namespace, prompts: list[str]) -> int:
    from minedraft.bench.offline import format_table, run_offline_bench

    engine = _engine_kwargs(args)
    engine.pop("speculative_config")
    modes = (args.modes or OFFLINE_MODES).split(",")
    results = run_offline_bench(prompts, modes, args.k, _sampling_params(args), repeats=args.repeats, **engine)
    print(format_table(results))
    return 0


def _online_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """run_online_bench options shared by --target and --launch."""
    return {
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "ignore_eos": args.ignore_eos,
        "stop": args.stop,
        "seed": args.sampling_seed if args.sampling_seed is not None else args.seed,
        "timeout": args.timeout,
        "warmup": args.warmup,
    }


def _bench_target(args: argparse.Namespace, prompts: list[str]) -> int:
    from minedraft.bench.online import format_result, run_online_bench, to_json

    result = run_online_bench(args.target, prompts, metrics_url=args.metrics_url, **_online_kwargs(args))
    print(format_result(result))
    if args.json:
        Path(args.json).write_text(to_json(result, per_request=True) + "\n", encoding="utf-8")
    return 0 if not result.failed else 1


def _bench_k8s(args: argparse.Namespace, prompts: list[str]) -> int:
    """The --target benchmark through a port-forward to the scheduler Service, closed afterwards."""
    from minedraft.bench.k8s import SCHEDULER_PORT, port_forward

    with port_forward(args.service, args.namespace, method=args.port_forward) as target:
        print(f"forwarding {target} -> svc/{args.service}:{SCHEDULER_PORT} in namespace {args.namespace}", flush=True)
        args.target = target
        return _bench_target(args, prompts)


def _bench_launch(args: argparse.Namespace, prompts: list[str]) -> int:
    import tempfile

    from minedraft.bench.launch import format_comparison, greedy_mismatches, run_launch_bench
    from minedraft.bench.online import to_json

    engine = _engine_kwargs(args)
    engine.pop("speculative_config")
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="minedraft-bench-"))
    modes = (args.modes or LAUNCH_MODES).split(",")
    try:
        results = run_launch_bench(
            modes, args.k, engine, prompts, log_dir=log_dir, log_level=args.log_level,
            draft_model=args.draft_model, repeats=args.repeats, **_online_kwargs(args),
        )  # fmt: skip
    except (RuntimeError, TimeoutError, ConnectionError) as exc:
        raise RuntimeError(f"{exc} (service logs: {log_dir})") from exc
    print(format_comparison(results))
    if args.temperature == 0:
        for mode, count in greedy_mismatches(results).items():
            if count:
                print(f"warning: {count} greedy outputs of {mode} differ from {modes[0]}'s", flush=True)
    if args.json:
        Path(args.json).write_text(to_json(results, per_request=True) + "\n", encoding="utf-8")
    return 0 if not any(r.failed for r in results.values()) else 1


def cmd_verifier(args: argparse.Namespace) -> int:
    from minedraft.serving import configure_logging
    from minedraft.verifier.service import serve_verifier

    configure_logging(args.log_level)
    serve_verifier(_engine_config(args), _dist_config(args), args.host, args.port)
    return 0


def cmd_drafter(args: argparse.Namespace) -> int:
    from minedraft.drafter.service import serve_drafter
    from minedraft.serving import configure_logging

    configure_logging(args.log_level)
    serve_drafter(_engine_config(args), _dist_config(args), args.host, args.port)
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    from minedraft.scheduler.service import serve_scheduler
    from minedraft.serving import configure_logging

    configure_logging(args.log_level)
    asyncio.run(
        serve_scheduler(
            _engine_config(args),
            host=args.host,
            port=args.port,
            verifier=args.verifier,
            drafter=args.drafter,
            max_waiting=args.max_waiting_requests,
            metrics_port=args.metrics_port,
            startup_timeout_s=args.startup_timeout,
            step_deadline_floor_s=args.step_deadline_floor,
            drain_timeout_s=args.drain_timeout,
        )
    )
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    from minedraft.launcher import LocalStack

    config = _engine_config(args)  # validate before starting anything
    # SIGTERM (and SIGINT, even when a non-interactive shell started us with it ignored) stop the stack
    # through the context manager, so no service process is left behind.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    with LocalStack(
        config,
        host=args.host,
        port=args.port,
        max_waiting=args.max_waiting_requests,
        log_level=args.log_level,
        metrics_port=args.metrics_port,
        drain_timeout_s=args.drain_timeout,
    ) as stack:
        print(f"MineDraft ({config.mode.value}) is serving on {stack.address}; Ctrl-C stops it", flush=True)
        if args.metrics_port:
            print(f"Prometheus metrics: http://{args.host}:{args.metrics_port}/metrics", flush=True)
        stack.wait()
        return _report_exited(stack.exited())


def _report_exited(exited: list[tuple[str, int]]) -> int:
    """`minedraft up`'s exit code: 0 after a signal, 1 when a service died on its own (named on stderr)."""
    for name, code in exited:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        print(f"minedraft up: the {name} {how}; stopping the other services", file=sys.stderr, flush=True)
    return 1 if exited else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minedraft", description="MineDraft: batch parallel speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text in this process (offline API)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser(
        "bench",
        help="benchmark decoding modes: in this process (--offline), against a server (--target), or on local "
        "stacks started mode by mode (--launch)",
        description="Three ways to benchmark. --offline: the engine in this process, mode by mode (tokens/s, "
        "accepted length). --target HOST:PORT: streamed requests against a running server, measured at the "
        "client (TTFT, ITL, E2E, throughput). --launch: for each of --modes, start verifier, drafter and "
        "scheduler locally (the engine flags apply), run the --target benchmark on it, stop it; then one "
        "side-by-side table. See benchmarks/README.md.",
    )
    how = bench.add_mutually_exclusive_group(required=True)
    how.add_argument("--offline", action="store_true", help="run the engine in this process, mode by mode")
    how.add_argument("--target", metavar="HOST:PORT", help="benchmark the MineDraft server at this address")
    how.add_argument("--launch", action="store_true", help="start a local stack per mode and benchmark each")
    how.add_argument(
        "--k8s", action="store_true", help="benchmark a release in Kubernetes through a port-forward to its scheduler"
    )
    k8s = bench.add_argument_group("kubernetes (--k8s)")
    k8s.add_argument("--namespace", default="default", help="namespace of the release")
    k8s.add_argument("--service", default="minedraft-scheduler", help="the scheduler Service (<release>-scheduler)")
    k8s.add_argument(
        "--port-forward",
        choices=("kubectl", "client"),
        default="kubectl",
        help="kubectl: `kubectl port-forward svc/...` as a subprocess; client: the kubernetes Python client",
    )
    bench.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated modes to compare, of {OFFLINE_MODES}; default: {OFFLINE_MODES} "
        f"with --offline, {LAUNCH_MODES} with --launch",
    )
    bench.add_argument("--k", type=int, default=4, help="num_speculative_tokens for the speculative modes")
    bench.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="--offline / --launch: interleaved rounds over all modes; each mode's median is reported",
    )
    bench.add_argument(
        "--dataset", default=None, help="prompts: .jsonl of {prompt} or ShareGPT .json; default: bundled held-out"
    )
    bench.add_argument("--num-prompts", type=int, default=64, help="use the first N prompts of the dataset")
    online = bench.add_argument_group("online (--target, --launch)")
    online.add_argument("--concurrency", type=int, default=16, help="most requests in flight at once")
    online.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests per second, arriving as a Poisson process (still capped by --concurrency); "
        "default: send as fast as the concurrency allows",
    )
    online.add_argument("--timeout", type=float, default=600.0, help="per-request deadline in seconds")
    online.add_argument(
        "--warmup", type=int, default=2, help="requests sent (and not measured) before the run, per server"
    )
    online.add_argument(
        "--metrics-url",
        default=None,
        help="--target only: the scheduler's Prometheus endpoint (e.g. http://127.0.0.1:9090/metrics), scraped "
        "before and after the run for step times, overhead and overlap",
    )
    online.add_argument("--json", metavar="FILE", default=None, help="also write the results, per request, as JSON")
    online.add_argument(
        "--draft-model", default=None, help="--launch: draft checkpoint of the speculative modes; default: bundled"
    )
    online.add_argument("--log-dir", default=None, help="--launch: service logs; default: a new temporary folder")
    online.add_argument("--log-level", default="INFO", help="--launch: the services' log level")
    _add_engine_args(bench)
    _add_sampling_args(bench, temperature=0.0, max_tokens=64)
    bench.set_defaults(func=cmd_bench)

    up = sub.add_parser(
        "up",
        help="start verifier, drafter and scheduler as local processes (the embedded default)",
        description="Start the whole stack on this machine with the bundled models, in MineDraft mode unless "
        "--speculative-config says otherwise ('null' = plain autoregressive decoding).",
    )
    _add_engine_args(up, speculative_default=UP_SPECULATIVE_DEFAULT)
    _add_listen_args(up, port=50051, host="127.0.0.1")
    _add(up, "--max-waiting-requests", 256, type=int, help="queued requests beyond this get RESOURCE_EXHAUSTED")
    _add(up, "--metrics-port", 9090, type=int, help="the scheduler's Prometheus port (0 = off)")
    _add(
        up,
        "--drain-timeout",
        30.0,
        type=float,
        help="on SIGTERM/SIGINT: seconds the scheduler gets to finish the running requests before the workers stop",
    )
    up.set_defaults(func=cmd_up)

    verifier = sub.add_parser("verifier", help="run the verifier service (all tensor-parallel ranks), as a pod does")
    _add_engine_args(verifier)
    _add_listen_args(verifier, port=50061)
    _add_dist_args(verifier)
    verifier.set_defaults(func=cmd_verifier)

    drafter = sub.add_parser("drafter", help="run the drafter service, as a pod does")
    _add_engine_args(drafter)
    _add_listen_args(drafter, port=50062)
    _add_dist_args(drafter)
    drafter.set_defaults(func=cmd_drafter)

    scheduler = sub.add_parser("scheduler", help="run the scheduler (public gRPC API), as a pod does")
    _add_engine_args(scheduler)
    _add_listen_args(scheduler, port=50051)
    _add(scheduler, "--verifier", "127.0.0.1:50061", help="verifier rank 0's gRPC address")
    _add(scheduler, "--drafter", "127.0.0.1:50062", help="drafter's gRPC address (ignored without speculation)")
    _add(scheduler, "--max-waiting-requests", 256, type=int, help="queued requests beyond this: RESOURCE_EXHAUSTED")
    _add(scheduler, "--metrics-port", 9090, type=int, help="Prometheus port (0 = off)")
    _add(scheduler, "--startup-timeout", 1800.0, type=float, help="seconds to wait for the workers to load")
    _add(
        scheduler,
        "--drain-timeout",
        30.0,
        type=float,
        help="on SIGTERM: stop admitting (NOT_SERVING, new requests get UNAVAILABLE) and give the running "
        "requests this many seconds to finish; the rest then get UNAVAILABLE",
    )
    _add(
        scheduler,
        "--step-deadline-floor",
        60.0,
        type=float,
        help="a step that takes longer than max(this, 10 x the 99th percentile of recent steps) counts as a hung "
        "worker: its requests fail with UNAVAILABLE and the scheduler turns NOT_SERVING",
    )
    scheduler.set_defaults(func=cmd_scheduler)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    watch_parent_from_env()  # a service started by `minedraft up` stops when it is gone
    try:
        return args.func(args)
    except ValidationError as exc:
        print(f"minedraft {args.command}: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"minedraft {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
