"""gRPC client SDK of a MineDraft server (no torch: safe to import in light applications).

    from minedraft.client import Client

    with Client("localhost:50051", token="...") as client:
        print(client.generate("Hello", max_tokens=32).text)
        for delta in client.stream("Hello", max_tokens=32):
            print(delta.text, end="", flush=True)

More sampling options go by their SamplingParameters names (`presence_penalty`, `frequency_penalty`,
`repetition_penalty`, `logit_bias`, `min_p`, `min_tokens`, `logprobs`, `bad_words`, `structured_outputs`):
`client.generate("Hi", logprobs=2)`, `client.generate("Hi", structured_outputs={"choice": ["yes", "no"]})`.
`AsyncClient` has the same methods as coroutines (`stream` is an async iterator). Failed calls raise
`MineDraftError`, a `grpc.RpcError` with the server's `.code()` and `.details()`.
"""

from minedraft.client._aio import AsyncClient
from minedraft.client._common import GenerateArguments
from minedraft.client._sync import Client
from minedraft.client.retry import RetryPolicy
from minedraft.client.types import (
    Completion,
    Delta,
    MineDraftError,
    ServerInfo,
    SpecDecodeStats,
    TokenLogprob,
    Usage,
)

__all__ = [
    "AsyncClient",
    "Client",
    "Completion",
    "Delta",
    "GenerateArguments",
    "MineDraftError",
    "RetryPolicy",
    "ServerInfo",
    "SpecDecodeStats",
    "TokenLogprob",
    "Usage",
]
