"""A worker's intra-op threads on a CPU that it shares with the other worker, chosen per step part.

Drafter and verifier processes on one machine (`minedraft up`, a laptop) share its cores. A part that runs
while the other worker computes too (an overlapped step) takes its share of the cores, since two thread pools
that oversubscribe them spin against each other; a part that runs alone (a plain step, either half of a
one-batch step) takes every core the process was started with. Switching costs well under a microsecond when
the count is unchanged and a few when it changes (torch keeps its pool)."""

from __future__ import annotations

import torch


class StepThreads:
    """`beside`: threads for a part that runs beside the other worker's (0: as many as alone)."""

    def __init__(self, device: str, beside: int) -> None:
        self.alone = torch.get_num_threads()
        self.beside = min(beside, self.alone) if device == "cpu" and beside > 0 else self.alone
        self._current = self.alone

    def use(self, together: bool) -> None:
        """Set this thread's intra-op threads for a part that runs beside the other's (`together`) or alone."""
        count = self.beside if together else self.alone
        if count != self._current:
            torch.set_num_threads(count)
            self._current = count
