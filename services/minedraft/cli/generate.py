"""`minedraft generate`: text from the offline API, in this process."""

from __future__ import annotations

import argparse
import json
from typing import Any

from minedraft.cli.common import add_engine_args, add_sampling_args, engine_config, sampling_options


def cmd_generate(args: argparse.Namespace) -> int:
    from minedraft.llm import LLM

    params = sampling_options(args).params()
    llm = LLM(**engine_config(args).model_dump())
    try:
        outputs = llm.generate(args.prompt, params, use_tqdm=not args.json and len(args.prompt) > 1)
    finally:
        llm.close()
    for out in outputs:
        completion = out.outputs[0]
        print(json.dumps(_record(out), ensure_ascii=False) if args.json else out.prompt + completion.text)
    return 0


def _record(out: Any) -> dict[str, Any]:
    """One prompt's output as --json prints it."""
    completion, stats = out.outputs[0], out.spec_decode_stats
    return {
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


def add_generate_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="generate text in this process (offline API)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
