"""MineDraft: batch parallel speculative decoding.

The offline API is imported lazily so that light users (the gRPC client SDK) never pay for torch.
"""

import os
from typing import TYPE_CHECKING

from minedraft.version import __version__

# OpenMP's idle threads spin a short while, then sleep (docs/performance.md, "A CPU-bound neighbour"): the
# default spin (300,000 turns) makes every parallel region wait on a thread that another process, or the other
# worker, holds the core from, and a busy neighbour then cut throughput to a tenth; a short spin keeps the
# quiet speed. Read by GNU OpenMP when torch loads, so it applies where minedraft is imported first (the CLI,
# the services, `minedraft.LLM` in a fresh interpreter); a value set in the environment wins. The benchmarks
# start their peers (vLLM) without a spin set here, so that a peer runs as it would on its own.
_GOMP_SPINCOUNT_DEFAULTED = "GOMP_SPINCOUNT" not in os.environ
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from minedraft.llm import LLM
    from minedraft.sampling.params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":
        from minedraft.llm import LLM

        return LLM
    if name == "SamplingParams":
        from minedraft.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'minedraft' has no attribute {name!r}")
