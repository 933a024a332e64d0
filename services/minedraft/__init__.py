"""MineDraft: batch parallel speculative decoding.

The offline API is imported lazily so that light users (the gRPC client SDK) never pay for torch.
"""

from typing import TYPE_CHECKING

from minedraft.version import __version__

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
