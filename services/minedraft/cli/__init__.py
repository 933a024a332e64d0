"""`minedraft ...`: the command-line entry point (also `python -m minedraft`).

One module per group of commands: `generate`, `bench` (its options in `bench_options`), `serve` (up, gateway,
scheduler, verifier, drafter); `common` holds what they share and `flags` turns pydantic models into flags.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from minedraft.cli.bench import add_bench_parser
from minedraft.cli.generate import add_generate_parser
from minedraft.cli.serve import add_serve_parsers
from minedraft.service.lifetime import watch_parent_from_env
from minedraft.settings import ListenError, StartupError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minedraft", description="MineDraft: batch parallel speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_serve_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    watch_parent_from_env()  # a service started by `minedraft up` stops when it is gone
    try:
        return args.func(args)
    except ValidationError as exc:
        print(f"minedraft {args.command}: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, ListenError, StartupError) as exc:
        print(f"minedraft {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
