"""ModelRunner API: paged KV blocks, input validation, a prepared batch run by another runner."""

from __future__ import annotations

import pytest
import torch

from minedraft.model.attention import attend, plan_attention
from minedraft.model.kv_cache import KVCache
from minedraft.model.runner import ModelRunner, SeqInput

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


def test_sequences_take_blocks_as_they_grow_and_give_them_back(runner):
    """2 sequences of 32 tokens in blocks of 16: a pool of 4 blocks; rollback frees whole trailing blocks."""
    cache = runner.kv_cache
    assert (cache.num_blocks, cache.block_size, runner.num_free_blocks) == (4, 16, 4)
    a, b = runner.allocate_slot(), runner.allocate_slot()
    runner.forward([SeqInput(a, list(range(1, 21)), 0), SeqInput(b, [1], 0)])
    assert len(cache.block_tables[a]) == 2 and len(cache.block_tables[b]) == 1 and runner.num_free_blocks == 1
    runner.forward([SeqInput(a, [7], 10)])  # rolled back to 10 tokens, then one written: 11 fit in one block
    assert len(cache.block_tables[a]) == 1 and cache.lengths[a] == 11 and runner.num_free_blocks == 2
    runner.free_slot(a)
    runner.free_slot(b)
    assert runner.num_free_blocks == 4 and not cache.block_tables
    with pytest.raises(ValueError, match="sequence 1 is not allocated"):
        runner.free_slot(b)


def test_out_of_blocks_is_a_clear_error(runner):
    a, b, c = runner.allocate_slot(), runner.allocate_slot(), runner.allocate_slot()
    runner.forward([SeqInput(a, [1] * 32, 0), SeqInput(b, [1] * 17, 0)])
    with pytest.raises(RuntimeError, match=r"KV cache is out of blocks: sequence 2 needs 1 more block\(s\) of 16 "
                                           r"tokens, 0 of 4 are free"):
        runner.forward([SeqInput(c, [1], 0)])


def test_blocks_are_handed_out_lowest_first_unless_the_next_one_is_free():
    cache = KVCache(num_layers=1, num_blocks=6, block_size=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    device="cpu")  # fmt: skip
    a, b = cache.allocate(), cache.allocate()
    cache.fit(a, 3)
    cache.fit(b, 2)
    assert cache.block_tables == {a: [1, 2], b: [3]}
    cache.fit(a, 2)  # rollback: block 2 goes back
    cache.fit(b, 4)  # b grows into the block after its last one, which is free
    assert cache.block_tables == {a: [1], b: [3, 4]} and cache.token_index(b, 1, 4) == [7, 8, 9]
    cache.fit(a, 6)  # block 2 follows a's block 1; then 3 is taken, so the lowest free one: 5
    assert cache.block_tables[a] == [1, 2, 5] and cache.num_free_blocks == 1
    c = cache.allocate()
    cache.fit(c, 2)  # the heap's stale entries (2 was taken out of turn) are never handed out twice
    assert cache.block_tables[c] == [6] and cache.num_free_blocks == 0
    cache.free(a)
    cache.free(b)
    assert cache.num_free_blocks == 5
    cache.fit(c, 12)  # 6 blocks: 6 then the lowest free ones, each taken once
    assert cache.block_tables[c] == [6, 1, 2, 3, 4, 5] and cache.num_free_blocks == 0


@pytest.mark.parametrize("query", [1, 3, 40])
def test_attention_over_a_run_of_blocks_reads_them_in_place_with_the_same_result(query: int):
    """One sequence whose blocks are consecutive in the pool: sdpa reads a view of the pool, bit for bit the
    result of gathering its blocks (a table out of order takes the gather)."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    k_cache, v_cache = (torch.randn(kv_heads, 30, block, dim) for _ in range(2))
    q = torch.randn(query, heads, dim)
    start = 37
    for table, in_place in (list(range(5, 25)), True), ([5, 6, 7, 9] + list(range(10, 26)), False):
        plan = plan_attention([start], [query], [table], block, heads, kv_heads, torch.device("cpu"), False)
        read = plan.seqs[0] if plan.seqs else plan.padded
        assert (read.run is not None) == in_place
        out = attend(q, k_cache, v_cache, plan, 0.3)
        read.run = None
        assert torch.equal(out, attend(q, k_cache, v_cache, plan, 0.3))


def test_a_budget_below_one_request_is_refused_with_the_numbers(path):
    # 1 layer x 2 (k, v) x 4 kv heads x 16 tokens x 32 dims x 4 bytes = 8192 bytes per block; 32 tokens need 2
    with pytest.raises(ValueError, match=r"KV cache budget \(kv_cache_memory_bytes=10000; 8192 bytes per block\) "
                                         r"holds 1 blocks of 16 tokens, .* max_model_len 32 needs 2 blocks"):
        ModelRunner(path, num_slots=2, max_seq_len=32, kv_cache_memory_bytes=10000)
    assert ModelRunner(path, num_slots=8, max_seq_len=32, kv_cache_memory_bytes=16384).kv_cache.num_blocks == 2


@pytest.mark.parametrize(
    ("seq", "message"),
    [
        (SeqInput(5, [1], 0), "sequence 5 is not allocated"),
        (SeqInput(0, [], 0), "token_ids is empty"),
        (SeqInput(0, [1], 4), r"start_pos 4 must be in \[0, 3\]"),
        (SeqInput(0, [1], -1), r"start_pos -1 must be in \[0, 3\]"),
        (SeqInput(0, [1] * 30, 3), "start_pos 3 \\+ 30 tokens exceeds max_seq_len 32"),
        (SeqInput(0, [1, 2], 3, num_logits=3), r"num_logits 3 must be in \[0, 2\]"),
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
    with pytest.raises(ValueError, match="sequence 0 appears twice in one batch"):
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


def test_prepared_batch_executes_on_another_runner(path):
    # The layers' ops, as under tensor parallelism (the one-call CPU stack runs from the host lists, on one rank).
    a, b = (ModelRunner(path, num_slots=2, max_seq_len=32, fused_kernels="off") for _ in range(2))
    seqs = [SeqInput(a.allocate_slot(), [5, 6, 7, 8], 0, num_logits=2), SeqInput(a.allocate_slot(), [9], 0)]
    batch = a.prepare(seqs)
    assert batch.positions.tolist() == [0, 1, 2, 3, 0] and batch.logits_indices.tolist() == [2, 3, 4]
    # a second runner (like a TP rank > 0) executes the prepared batch without any slot bookkeeping
    assert torch.equal(a.forward(seqs), b.execute(batch))
