"""`minedraft ...`: the command-line entry point (also `python -m minedraft`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import ValidationError


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None, help="target checkpoint folder (HF format); default: bundled target"
    )
    group.add_argument(
        "--speculative-config",
        default=None,
        help='MineDraft JSON, e.g. \'{"num_speculative_tokens": 4, "is_parallel": true}\'; default: none (plain '
        "autoregressive decoding)",
    )
    group.add_argument("--tensor-parallel-size", type=int, default=1, help="target tensor-parallel size")
    group.add_argument(
        "--max-num-seqs", type=int, default=16, help="requests per batch (MineDraft keeps two)"
    )
    group.add_argument(
        "--max-model-len", type=int, default=None, help="most tokens per request; default: model's"
    )
    group.add_argument(
        "--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16"
    )
    group.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    group.add_argument("--seed", type=int, default=0, help="seed of requests that bring none")


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


def _add_sampling_args(
    parser: argparse.ArgumentParser, temperature: float = 1.0, max_tokens: int = 16
) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minedraft", description="MineDraft: batch parallel speculative decoding"
    )
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
