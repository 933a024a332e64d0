"""Tensor transport between the verifier ranks and the drafter over torch.distributed (NCCL or gloo).

Only fixed-dtype tensors travel, never pickles; the control plane (step plans over gRPC) lives elsewhere.
"""

from minedraft.transport.channel import StepChannel
from minedraft.transport.groups import Topology, WorldGroups, init_world, pick_backend

__all__ = ["StepChannel", "Topology", "WorldGroups", "init_world", "pick_backend"]
