"""How the local stack shares one machine's cores among its model processes."""

from minedraft.config import EngineConfig
from minedraft.stack.local import threads_beside, threads_per_worker


def test_workers_that_take_turns_use_every_core() -> None:
    assert threads_per_worker(EngineConfig(), 8) == 8
    assert threads_per_worker(EngineConfig(speculative_config={"num_speculative_tokens": 4}), 8) == 8


def test_tensor_parallel_ranks_split_the_cores_and_overlapped_parts_take_a_share() -> None:
    minedraft = {"num_speculative_tokens": 4, "is_parallel": True}
    pearl = {**minedraft, "force_pearl": True}
    assert threads_per_worker(EngineConfig(speculative_config=minedraft), 8) == 8  # a part alone: every core
    assert threads_beside(EngineConfig(speculative_config=minedraft), 8) == 4  # beside the other part: a share
    assert threads_beside(EngineConfig(speculative_config=pearl), 8) == 4
    assert threads_beside(EngineConfig(speculative_config={"num_speculative_tokens": 4}), 8) == 0  # sd: turns
    assert threads_per_worker(EngineConfig(speculative_config=minedraft, tensor_parallel_size=2), 8) == 4
    assert threads_beside(EngineConfig(speculative_config=minedraft, tensor_parallel_size=2), 8) == 2
    assert threads_per_worker(EngineConfig(tensor_parallel_size=4), 2) == 1
