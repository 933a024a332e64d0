"""Counter-based random numbers: every draw is a pure function of its key.

A key is (request seed, stream, output position, counter). Hashing the key with splitmix64's mixing
function gives 64 random bits, and their top 53 bits give a float64 uniform in [0, 1). Nothing is
carried from one draw to the next, so a request that is re-admitted (after a failure, a preemption or
a migration) with its prompt and the tokens it already has draws exactly the numbers it would have
drawn, whatever ran before and whatever else is in the batch. All of it is int64 tensor arithmetic,
vectorised over the batch, on the logits' device.

Streams keep the drafter's and the verifier's draws apart (they must be independent for rejection
sampling to be exact), and the verifier's acceptance tests apart from its final-token draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Stream ids (arbitrary distinct constants).
DRAFT = 0x0D5A
ACCEPT = 0x0A11
FINAL = 0x0F17

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: Tensor) -> Tensor:
    """splitmix64: add the golden gamma, then its finaliser (int64 multiplication wraps mod 2^64)."""
    x = x + _signed(_GOLDEN)
    x = (x ^ _shift_right(x, 30)) * _signed(_MIX1)
    x = (x ^ _shift_right(x, 27)) * _signed(_MIX2)
    return x ^ _shift_right(x, 31)


def seed_tensor(seeds: list[int], device: torch.device | str = "cpu") -> Tensor:
    """Request seeds (any Python ints; the low 64 bits count) as an int64 tensor."""
    return torch.tensor([_signed(s) for s in seeds], dtype=torch.int64, device=device)


def uniforms(seeds: Tensor, stream: int, positions: Tensor, counters: Tensor | int = 0) -> Tensor:
    """float64 uniforms in [0, 1), one per element of the broadcast (seeds, positions, counters)."""
    x = _mix(seeds ^ _signed(stream * _GOLDEN))
    x = _mix(x ^ positions)
    x = _mix(x ^ counters)
    return _shift_right(x, 11).double() * 2.0**-53


@dataclass(frozen=True)
class RowKeys:
    """Where each row's draws come from: its request's seed and the output position it samples.

    ``counters`` tells apart draws at the same position that must be independent (the drafter keys a
    window's draws by the position the window starts at, so a window redrafted after a rejection draws
    fresh numbers, and the same window after a re-admission draws the same ones)."""

    seeds: Tensor  # [B] int64
    positions: Tensor  # [B] int64
    counters: Tensor | None = None  # [B] int64, or None for 0

    @staticmethod
    def of(seeds: list[int], positions: list[int], counters: list[int] | None = None, device="cpu") -> RowKeys:
        as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        return RowKeys(seed_tensor(seeds, device), as_long(positions), None if counters is None else as_long(counters))

    def __len__(self) -> int:
        return self.seeds.shape[0]

    def draw(self, stream: int, device: torch.device, offsets: Tensor | None = None) -> Tensor:
        """One uniform per row at its position [B]; with ``offsets`` [W], one per row and offset at
        ``position + offset`` [B, W]. On ``device``."""
        seeds, positions = self.seeds.to(device), self.positions.to(device)
        counters = 0 if self.counters is None else self.counters.to(device)
        if offsets is not None:
            seeds, positions = seeds[:, None], positions[:, None] + offsets.to(device)[None, :]
            counters = counters if isinstance(counters, int) else counters[:, None]
        return uniforms(seeds, stream, positions, counters)
