"""The optional extras of pyproject.toml, and the one line that names the extra a missing package comes with.

What needs an optional package checks for it before any work (`require`): when the command line is parsed,
when a model is loaded with a setting that needs it, when a request asks for it. The user then reads which
extra to install, not a traceback halfway through a run.
"""

from __future__ import annotations

import importlib.util

# optional package -> the extra that installs it (pyproject.toml's optional-dependencies)
EXTRAS = {"matplotlib": "bench", "xgrammar": "structured", "triton": "gpu"}


def require(package: str, needed_by: str) -> None:
    """ValueError("--plot needs matplotlib: pip install 'minedraft[bench]'") when `package` is not installed."""
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"{needed_by} needs {package}: pip install 'minedraft[{EXTRAS[package]}]'")
