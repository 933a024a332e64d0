"""The drafter's and the verifier's model-side work, independent of how they talk to each other: `DraftWorker`
(drafter.py) and `VerifyWorker` (verifier.py), over what both share (base.py) and the request each holds, a mirror
of its committed tokens beside what its KV cache holds (sequence.py)."""

from minedraft.engine.workers.base import point_mass, sparse_q
from minedraft.engine.workers.drafter import DraftWorker
from minedraft.engine.workers.verifier import VerifyBatch, VerifyWorker

__all__ = ["DraftWorker", "VerifyBatch", "VerifyWorker", "point_mass", "sparse_q"]
