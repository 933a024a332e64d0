"""`minedraft bench` (offline, against a running server, against stacks it launches, in Kubernetes, under chaos)
and `minedraft bench compare A B`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from minedraft.cli.bench_options import BENCH_GROUPS, LAUNCH_MODES, OFFLINE_MODES, BenchOptions, BenchRun, BenchWay
from minedraft.cli.common import add_engine_args, add_sampling_args, engine_config
from minedraft.cli.flags import add_flags, given_flags, options_from_args
from minedraft.config import EngineConfig
from minedraft.extras import require


def bench_options(args: argparse.Namespace) -> BenchOptions:
    """The bench flags, checked (each against its bounds, then against one another) before anything loads."""
    options = options_from_args(args, BenchOptions)
    # --tokenizer also tells a run against a server how to make random prompts and count its output
    engine_flags = [f for f in given_flags(args, EngineConfig) if f != "--tokenizer"] + (
        ["--engine-config"] if args.engine_config is not None else [])
    if engine_flags and not (options.offline or options.launch):
        raise ValueError(f"engine flags ({', '.join(engine_flags)}) configure the engines that --offline and "
                         "--launch start; a running server (--target, --base-url, --k8s) keeps its own")  # fmt: skip
    if options.plot:
        require("matplotlib", "--plot")
    return options


def cmd_bench(args: argparse.Namespace) -> int:
    options = bench_options(args)
    config = engine_config(args)
    requests = _bench_requests(options, config)
    if options.chaos:
        return _bench_chaos(options, config, requests)
    if options.offline:
        return _bench_offline(options, config, [r.prompt for r in requests])
    try:
        if options.k8s:
            return _bench_k8s(options, config, requests)
        if options.launch:
            return _bench_launch(options, config, requests)
        return _bench_server(options, config, requests)
    except (RuntimeError, TimeoutError, ConnectionError, LookupError) as exc:  # a server that did not start or answer
        print(f"minedraft bench: {exc}", file=sys.stderr)
        return 1


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from minedraft.bench.report import compare_files

    print(compare_files(args.a, args.b))
    return 0


def _bench_requests(options: BenchOptions, config: EngineConfig) -> list:
    """The dataset's requests: random token prompts of --input-len, or the prompts of a file."""
    from minedraft.bench.prompts import RANDOM, BenchRequest, load_prompts, random_requests

    if options.dataset != RANDOM:
        return [BenchRequest(p) for p in load_prompts(options.dataset, limit=options.num_prompts)]
    output_len = options.output_len or options.max_tokens
    return random_requests(_bench_tokenizer(config), options.num_prompts, options.input_len, output_len,
                           options.random_range_ratio, seed=options.sampling_seed or 0)  # fmt: skip


def _bench_chaos(options: BenchOptions, config: EngineConfig, requests: list) -> int:
    """`bench --chaos`: token-id prompts (a stream broken by a kill is then resumed by the SDK), greedy."""
    from minedraft.bench.chaos import Chaos, Load, Stack, find_up, run_chaos

    try:
        stack = Stack(find_up(int(options.target.rsplit(":", 1)[1])))
    except LookupError as exc:
        print(f"minedraft bench: {exc}", file=sys.stderr)
        return 1
    tokenizer = _bench_tokenizer(config)
    prompts = [tokenizer.encode(r.prompt) for r in requests]
    token = options.bench_api_key or os.environ.get("OPENAI_API_KEY")
    load = Load(options.target, prompts, options.concurrency, options.max_tokens, token, options.temperature)
    chaos = Chaos(options.chaos_interval, options.chaos_duration, options.chaos_targets.split(","))
    text, clean = run_chaos(stack, load, chaos, out=lambda line: print(line, flush=True))
    print(text)
    return 0 if clean else 1


def _bench_tokenizer(config: EngineConfig):
    """The tokenizer that makes random prompts and counts the output of an OpenAI server that reports no usage:
    --tokenizer, else --model's (default: the bundled target's)."""
    from minedraft.model.tokenizer import load_tokenizer

    return load_tokenizer(config.tokenizer_path)


def _bench_offline(options: BenchOptions, config: EngineConfig, prompts: list[str]) -> int:
    from minedraft.bench.offline import format_table, run_offline_bench

    engine, speculative = _bench_engines(options, config)
    modes = (options.modes or OFFLINE_MODES).split(",")
    results = run_offline_bench(prompts, modes, speculative, options.params(), repeats=options.repeats, **engine)
    print(format_table(results))
    return 0


def _bench_engines(options: BenchOptions, config: EngineConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine settings of every compared mode, and the speculative keys the modes share.

    --speculative-config gives those keys (k, draft model, Tetris knobs; each mode sets is_parallel,
    force_pearl and tetris itself); --k and --draft-model are shorthands that may not contradict it.
    """
    engine = config.model_dump(exclude={"speculative_config"})
    spec = config.speculative_config
    shared = spec.model_dump(exclude_none=True) if spec else {"num_speculative_tokens": 4}
    shorthands = (("--k", "num_speculative_tokens", options.k), ("--draft-model", "model", options.draft_model))
    for flag, key, value in shorthands:
        if value is None:
            continue
        if spec is not None and shared.get(key) not in (None, value):
            raise ValueError(f"{flag} {value} contradicts --speculative-config's {key} ({shared[key]}); give one")
        shared[key] = value
    return engine, shared


def _online_kwargs(options: BenchOptions, config: EngineConfig) -> dict[str, Any]:
    """run_online_bench options shared by --target, --base-url, --k8s and --launch."""
    from minedraft.bench.online import Ramp
    from minedraft.bench.records import parse_percentiles, parse_slo

    ramp = options.ramp_up_strategy and Ramp(options.ramp_up_strategy, options.ramp_up_start_rps,
                                             options.ramp_up_end_rps)  # fmt: skip
    backend = options.backend_name
    return {
        "concurrency": options.concurrency, "request_rate": options.request_rate, "burstiness": options.burstiness,
        "ramp": ramp or None, "max_tokens": options.max_tokens, "temperature": options.temperature,
        "top_p": options.top_p, "top_k": options.top_k, "ignore_eos": options.ignore_eos, "stop": options.stop,
        "seed": options.sampling_seed if options.sampling_seed is not None else config.seed,
        "timeout": options.timeout, "warmup": options.warmup, "progress": options.progress_interval,
        "backend": backend, "model": options.served_model_name,
        "api_key": options.bench_api_key or os.environ.get("OPENAI_API_KEY"),
        # counts the output of an OpenAI server that sends no usage
        "tokenizer": _bench_tokenizer(config) if backend != "minedraft-grpc" else None,
        "percentiles": parse_percentiles(options.percentiles), "slo": parse_slo(options.slo),
    }  # fmt: skip


def _bench_server(options: BenchOptions, config: EngineConfig, requests: list) -> int:
    """One run against a running server (or one per --sweep-concurrency value), reported and written out."""
    from minedraft.bench.online import format_result, run_online_bench

    kwargs = _online_kwargs(options, config)
    results = {}
    for concurrency in options.sweep or [options.concurrency]:
        label = f"concurrency {concurrency}" if options.sweep else ""
        kwargs.update(concurrency=concurrency, label=label)
        results[label] = run_online_bench(options.server, requests, metrics_url=options.metrics_url, **kwargs)
        print(format_result(results[label]), flush=True)
    _write_bench_outputs(options, results, sweep=bool(options.sweep))
    return 0 if not any(r.failed for r in results.values()) else 1


def _write_bench_outputs(options: BenchOptions, results: dict, sweep: bool = False) -> None:
    """--json (one run: its object; several: keyed by name), --trace, --plot."""
    from minedraft.bench.report import plot, to_json, write_trace

    if options.json_file:
        single = len(results) == 1 and not sweep and not options.launch
        Path(options.json_file).write_text(to_json(next(iter(results.values())) if single else results) + "\n",
                                           encoding="utf-8")  # fmt: skip
    if options.trace:
        write_trace(results, options.trace)
    if options.plot:
        plot(results, options.plot, sweep=sweep)


def _bench_k8s(options: BenchOptions, config: EngineConfig, requests: list) -> int:
    """The --target benchmark through a port-forward to the release's public Service, closed afterwards."""
    from minedraft.bench.k8s import SCHEDULER_PORT, port_forward

    with port_forward(options.service, options.namespace, method=options.port_forward) as target:
        print(f"forwarding {target} -> svc/{options.service}:{SCHEDULER_PORT} in namespace {options.namespace}",
              flush=True)  # fmt: skip
        return _bench_server(options.model_copy(update={"target": target}), config, requests)


def _bench_launch(options: BenchOptions, config: EngineConfig, requests: list) -> int:
    import tempfile

    from minedraft.bench.launch import format_comparison, greedy_mismatches, run_launch_bench

    engine, speculative = _bench_engines(options, config)
    log_dir = Path(options.log_dir) if options.log_dir else Path(tempfile.mkdtemp(prefix="minedraft-bench-"))
    modes = (options.modes or LAUNCH_MODES).split(",")
    try:
        results = run_launch_bench(
            modes, speculative, engine, requests, log_dir=log_dir, log_level=options.log_level,
            repeats=options.repeats, **_online_kwargs(options, config),
        )  # fmt: skip
    except (RuntimeError, TimeoutError, ConnectionError) as exc:
        raise RuntimeError(f"{exc} (service logs: {log_dir})") from exc
    print(format_comparison(results))
    if options.temperature == 0:
        for mode, count in greedy_mismatches(results).items():
            if count:
                print(f"warning: {count} greedy outputs of {mode} differ from {modes[0]}'s", flush=True)
    _write_bench_outputs(options, results)
    return 0 if not any(r.failed for r in results.values()) else 1


BENCH_DESCRIPTION = (
    "Ways to benchmark. --offline: the engine in this process, mode by mode (tokens/s, accepted length). --target "
    "HOST:PORT (MineDraft gRPC) or --base-url URL with --backend openai|openai-chat (any OpenAI-compatible server: "
    "minedraft up --http-port, vllm serve, ...): streamed requests against a running server, measured at the client "
    "with vLLM's definitions (TTFT, TPOT, ITL per chunk, E2EL, token throughputs, goodput). --launch: for each of "
    "--modes, start verifier, drafter and scheduler locally (the engine flags apply), run the --target benchmark on "
    "it, stop it; then one side-by-side table. With --offline and --launch, --speculative-config gives the keys the "
    "speculative modes share (k, draft model, Tetris knobs); each mode sets is_parallel, force_pearl and tetris "
    "itself. `minedraft bench compare A.json B.json` tables two --json results (ours or vllm bench serve's). See "
    "benchmarks/README.md."
)


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench", description=BENCH_DESCRIPTION,
        help="benchmark: the engine in this process (--offline), a running server over gRPC (--target) or "
        "OpenAI's HTTP API (--base-url), local stacks started mode by mode (--launch); `bench compare A B`",
    )  # fmt: skip
    add_flags(bench.add_mutually_exclusive_group(), BenchWay, env=False)  # one of them, or `compare`: see BenchOptions
    add_flags(bench, BenchRun, env=False)
    groups: dict[str, Any] = {}
    for model, title in BENCH_GROUPS:
        add_flags(groups.setdefault(title, bench.add_argument_group(title)), model, env=False)
    add_engine_args(bench)
    add_sampling_args(bench, temperature=0.0, max_tokens=64)
    bench.set_defaults(func=cmd_bench)
    bench_sub = bench.add_subparsers(dest="bench_command", required=False, metavar="compare")
    compare = bench_sub.add_parser(
        "compare", help="a table of two --json results' figures, their differences and ratios",
        description="Compare two result files of `minedraft bench --json` (or `vllm bench serve --save-result`): "
        "every figure both have, with B - A and B / A. Files holding several runs (--launch, --sweep-concurrency) "
        "are compared run by run.",
    )  # fmt: skip
    compare.add_argument("a", metavar="A.json")
    compare.add_argument("b", metavar="B.json")
    compare.set_defaults(func=cmd_bench_compare)
