"""`minedraft ...`: the command-line entry point (also `python -m minedraft`).

One module per group of commands: `generate`, `bench` (its options in `bench_options`), `serve` (up, gateway,
scheduler, verifier, drafter); `common` holds what they share and `flags` turns pydantic models into flags.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pydantic import ValidationError

from minedraft.service.lifetime import watch_parent_from_env
from minedraft.settings import ListenError, StartupError

__all__ = ["build_parser", "main"]

# Each group's module, the function that adds its parsers, and its commands. A group is imported only when one
# of its commands runs (or for the whole help): a service process starts without the benchmark's modules.
_GROUPS = {
    "minedraft.cli.generate": ("add_generate_parser", ("generate",)),
    "minedraft.cli.bench": ("add_bench_parser", ("bench",)),
    "minedraft.cli.serve": ("add_serve_parsers", ("up", "gateway", "scheduler", "verifier", "drafter")),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or only the parsers of the group that `command` belongs to."""
    parser = argparse.ArgumentParser(prog="minedraft", description="MineDraft: batch parallel speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    for module, (add_parsers, commands) in _GROUPS.items():
        if command is None or command in commands:
            getattr(importlib.import_module(module), add_parsers)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    known = {c for _, commands in _GROUPS.values() for c in commands}
    args = build_parser(argv[0] if argv and argv[0] in known else None).parse_args(argv)
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
