"""Retry policy shared by both clients: exponential backoff with jitter, on UNAVAILABLE only."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to wait before another attempt.

    Only UNAVAILABLE is retried (the server was unreachable, draining or overloaded, so the request
    did not run). A stream that breaks after tokens arrived is resumed from where it broke (prompt + the
    tokens received, `ResumableStream`) when its prompt is token ids and it has no stop strings; otherwise
    only until its first message arrives, since a retry would repeat output the caller has already seen.
    The attempts count over the whole stream, its resumptions included.
    """

    max_attempts: int = 5  # the first attempt included; 1 disables retries
    initial_backoff: float = 0.1  # seconds before the second attempt
    multiplier: float = 2.0
    max_backoff: float = 5.0
    jitter: float = 0.2  # each wait is scaled by a uniform factor in [1 - jitter, 1 + jitter]

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.initial_backoff < 0 or self.multiplier < 1 or self.max_backoff < 0:
            raise ValueError("backoffs must be >= 0 and multiplier >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be in [0, 1]")

    @classmethod
    def coerce(cls, retries: RetryPolicy | int | None) -> RetryPolicy:
        """`retries=n` allows n retries after the first attempt; None or 0 disables retries."""
        if isinstance(retries, RetryPolicy):
            return retries
        if retries is None:
            return cls(max_attempts=1)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise TypeError(f"retries must be a RetryPolicy or an int >= 0, got {retries!r}")
        return cls(max_attempts=retries + 1)

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based), jitter included."""
        base = min(self.initial_backoff * self.multiplier ** (attempt - 1), self.max_backoff)
        factor = 1.0 + self.jitter * (2.0 * (rng or random).random() - 1.0)
        return base * factor


DEFAULT_RETRY_POLICY = RetryPolicy()  # 5 attempts, waits of about 0.1, 0.2, 0.4, 0.8 s


class Deadline:
    """One overall deadline for a call and all its retries."""

    def __init__(self, timeout: float | None) -> None:
        self._end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None without a deadline."""
        return None if self._end is None else max(0.0, self._end - time.monotonic())


def retry_delay(policy: RetryPolicy, err: grpc.RpcError, attempt: int, deadline: Deadline) -> float | None:
    """Seconds to sleep before retrying after `err` failed attempt `attempt`, or None to give up.

    Gives up when the code is not UNAVAILABLE, attempts are exhausted, or the wait would outlast the
    deadline (the caller then sees the real cause, not a synthetic DEADLINE_EXCEEDED).
    """
    code = err.code() if hasattr(err, "code") else None
    if code != grpc.StatusCode.UNAVAILABLE or attempt >= policy.max_attempts:
        return None
    delay = policy.backoff(attempt)
    remaining = deadline.remaining()
    if remaining is not None and delay >= remaining:
        return None
    return delay
