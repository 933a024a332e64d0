"""ModelRunner API: slots, input validation, ForwardBatch round trip."""

from __future__ import annotations

import pytest
import torch

from minedraft.model.kv_cache import KVCache
from minedraft.model.runner import ForwardBatch, ModelRunner, SeqInput

from tiny_models import make_tiny_checkpoint, torch_threads


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3", "qwen3", num_layers=1)


@pytest.fixture
def runner(path):
    return ModelRunner(path, num_slots=2, max_seq_len=32)


def test_public_attributes(runner):
    assert runner.config.vocab_size == 320 and runner.config.eos_token_ids == [2]
    assert runner.tokenizer.vocab_size == 320


def test_slots(runner):
    assert runner.num_free_slots == 2
    a, b = runner.allocate_slot(), runner.allocate_slot()
    assert {a, b} == {0, 1} and runner.num_free_slots == 0
    with pytest.raises(RuntimeError, match="no free KV-cache slot: all 2 slots are in use"):
        runner.allocate_slot()
    runner.free_slot(a)
    assert runner.num_free_slots == 1 and runner.allocate_slot() == a
    runner.free_slot(b)
    with pytest.raises(ValueError, match="slot 1 is not allocated"):
        runner.free_slot(b)


def test_slot_regions_keep_each_batch_together():
    """Each batch takes its slots from a region of its own; a full region lends from another."""
    cache = KVCache(num_layers=1, num_slots=4, num_kv_heads=1, max_seq_len=8, head_dim=2, dtype=torch.float32,
                    device="cpu", num_regions=2)  # fmt: skip
    assert [cache.allocate(1), cache.allocate(0), cache.allocate(1)] == [2, 0, 3]
    assert cache.allocate(1) == 1 and cache.num_free_slots == 0
    cache.free(3)
    cache.free(0)
    assert cache.allocate(1) == 3 and cache.allocate(0) == 0


@pytest.mark.parametrize(
    ("seq", "message"),
    [
        (SeqInput(5, [1], 0), r"slot 5 is out of range \[0, 2\)"),
        (SeqInput(1, [1], 0), "slot 1 is not allocated"),
        (SeqInput(0, [], 0), "token_ids is empty"),
        (SeqInput(0, [1], 4), r"start_pos 4 must be in \[0, 3\]"),
        (SeqInput(0, [1], -1), r"start_pos -1 must be in \[0, 3\]"),
        (SeqInput(0, [1] * 30, 3), "start_pos 3 \\+ 30 tokens exceeds max_seq_len 32"),
        (SeqInput(0, [1, 2], 3, num_logits=3), r"num_logits 3 must be in \[1, 2\]"),
        (SeqInput(0, [1, 320], 3), r"token id 320 is outside the vocabulary \[0, 320\)"),
        (SeqInput(0, [-1], 3), "token id -1 is outside the vocabulary"),
    ],
)
def test_invalid_inputs(runner, seq, message):
    slot = runner.allocate_slot()
    runner.forward([SeqInput(slot, [1, 2, 3], 0)])
    with pytest.raises(ValueError, match=message):
        runner.forward([seq])


def test_duplicate_slot_in_batch(runner):
    slot = runner.allocate_slot()
    with pytest.raises(ValueError, match="slot 0 appears twice in one batch"):
        runner.forward([SeqInput(slot, [1], 0), SeqInput(slot, [2], 0)])


def test_freed_slot_starts_empty(runner):
    slot = runner.allocate_slot()
    runner.forward([SeqInput(slot, [1, 2, 3], 0)])
    runner.free_slot(slot)
    slot = runner.allocate_slot()
    with pytest.raises(ValueError, match=r"start_pos 3 must be in \[0, 0\]"):
        runner.forward([SeqInput(slot, [4], 3)])


def test_output_shape_and_empty_batch(runner):
    a, b = runner.allocate_slot(), runner.allocate_slot()
    out = runner.forward([SeqInput(a, [5, 6, 7], 0, num_logits=2), SeqInput(b, [8], 0)])
    assert out.shape == (3, 320) and out.dtype == torch.float32 and out.device.type == "cpu"
    assert runner.forward([]).shape == (0, 320)


def test_forward_batch_flatten_round_trip_and_execute(path):
    a, b = ModelRunner(path, num_slots=2, max_seq_len=32), ModelRunner(path, num_slots=2, max_seq_len=32)
    seqs = [SeqInput(a.allocate_slot(), [5, 6, 7, 8], 0, num_logits=2), SeqInput(a.allocate_slot(), [9], 0)]
    batch = a.prepare(seqs)
    assert batch.positions.tolist() == [0, 1, 2, 3, 0] and batch.logits_indices.tolist() == [2, 3, 4]
    copy = ForwardBatch.unflatten(batch.flatten())
    for name in ("input_ids", "positions", "slots", "start_pos", "query_lens", "logits_indices"):
        assert torch.equal(getattr(copy, name), getattr(batch, name))
    # a second runner (like a TP rank > 0) executes the broadcast batch without any slot bookkeeping
    assert torch.equal(a.forward(seqs), b.execute(copy))
