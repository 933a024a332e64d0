"""`minedraft ...`: the command-line entry point (also `python -m minedraft`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from pydantic import ValidationError


def _env(flag: str, default: Any = None) -> Any:
    """Default of a flag from its environment variable: --max-num-seqs <- MINEDRAFT_MAX_NUM_SEQS."""
    return os.environ.get("MINEDRAFT_" + flag.lstrip("-").replace("-", "_").upper(), default)


def _add(group, flag: str, default: Any = None, **kwargs) -> None:
    env = "MINEDRAFT_" + flag.lstrip("-").replace("-", "_").upper()
    help_text = kwargs.pop("help", "")
    group.add_argument(flag, default=_env(flag, default), help=f"{help_text} [env {env}]".strip(), **kwargs)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them; each can also come from a MINEDRAFT_* variable."""
    group = parser.add_argument_group("engine")
    _add(group, "--model", help="target checkpoint folder (HF format); default: bundled target")
    _add(
        group,
        "--speculative-config",
        help='MineDraft JSON, e.g. \'{"num_speculative_tokens": 4, "is_parallel": true}\'; default: none (plain '
        "autoregressive decoding)",
    )
    _add(group, "--tensor-parallel-size", 1, type=int, help="target tensor-parallel size")
    _add(group, "--max-num-seqs", 16, type=int, help="requests per batch (MineDraft keeps two)")
    _add(group, "--max-model-len", type=int, help="most tokens per request; default: the model's")
    _add(group, "--dtype", "auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    _add(group, "--device", "auto", help="auto, cpu, cuda, cuda:N")
    _add(group, "--seed", 0, type=int, help="seed of requests that bring none")


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
    }


def _engine_config(args: argparse.Namespace):
    from minedraft.config import EngineConfig

    return EngineConfig(**_engine_kwargs(args))


def _add_dist_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("torch.distributed (drafter <-> verifier tensors)")
    _add(group, "--dist-addr", "127.0.0.1", help="verifier rank 0's address (rendezvous)")
    _add(group, "--dist-port", 29500, type=int, help="rendezvous port on verifier rank 0")
    _add(group, "--dist-backend", "auto", help="auto (NCCL on CUDA, gloo on CPU), nccl, gloo")


def _dist_config(args: argparse.Namespace):
    from minedraft.config import DistributedConfig

    return DistributedConfig(master_addr=args.dist_addr, master_port=args.dist_port, backend=args.dist_backend)


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
    from minedraft.bench.offline import format_table, run_offline_bench
    from minedraft.bench.prompts import load_prompts

    if not args.offline:
        print("minedraft bench: only --offline is available in this build", file=sys.stderr)
        return 2
    prompts = load_prompts(args.dataset, limit=args.num_prompts)
    engine = _engine_kwargs(args)
    engine.pop("speculative_config")
    results = run_offline_bench(prompts, args.modes.split(","), args.k, _sampling_params(args), **engine)
    print(format_table(results))
    return 0


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
        )
    )
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from minedraft.launcher import LocalStack

    config = _engine_config(args)  # validate before starting anything
    with LocalStack(
        config, host=args.host, port=args.port, max_waiting=args.max_waiting_requests, log_level=args.log_level
    ) as stack:
        print(f"MineDraft ({config.mode.value}) is serving on {stack.address}; Ctrl-C stops it", flush=True)
        stack.wait()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minedraft", description="MineDraft: batch parallel speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text in this process (offline API)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmark decoding modes side by side")
    bench.add_argument("--offline", action="store_true", help="run the engine in this process, mode by mode")
    bench.add_argument(
        "--modes", default="ar,sd,pearl,minedraft,minedraft+tetris", help="comma-separated modes to compare"
    )
    bench.add_argument("--k", type=int, default=4, help="num_speculative_tokens for the speculative modes")
    bench.add_argument("--dataset", default=None, help="prompts: .jsonl of {prompt} or ShareGPT .json")
    bench.add_argument("--num-prompts", type=int, default=64)
    _add_engine_args(bench)
    _add_sampling_args(bench, temperature=0.0, max_tokens=64)
    bench.set_defaults(func=cmd_bench)

    up = sub.add_parser("up", help="start verifier, drafter and scheduler as local processes (CPU default)")
    _add_engine_args(up)
    _add_listen_args(up, port=50051, host="127.0.0.1")
    _add(up, "--max-waiting-requests", 256, type=int, help="queued requests beyond this get RESOURCE_EXHAUSTED")
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
    scheduler.set_defaults(func=cmd_scheduler)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
