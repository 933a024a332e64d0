"""Tensor-parallel context: rank, size and collectives over an explicit process group.

Never the world group: a drafter process may be in the world but not in the target's TP group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallel:
    """Shared by every layer of a model. The group can be replaced (`bind`) when the world is formed again
    after a failure: the shards stay loaded, only the communicator changes."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1

    def bind(self, group: dist.ProcessGroup | None) -> None:
        if self.size > 1 and (group is None or dist.get_world_size(group) != self.size):
            raise ValueError(f"a tensor-parallel model of {self.size} ranks needs a group of {self.size} ranks")
        self.group = group

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None) -> TensorParallel:
        if group is None:
            return cls()
        return cls(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group))

    def shard(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total` (which must divide evenly)."""
        size = total // self.size
        return self.rank * size, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)
