"""The Triton paged-attention kernel against the attention we already trust, on CPU through Triton's
interpreter (the same kernel source a GPU compiles; there, bf16 operands go to the tensor cores, here the
interpreter multiplies them in fp32, see triton_attention._INTERPRETED).

Cases: decode (one query), k + 1 verification queries, prefill, contexts of every length around a block
boundary, block tables with holes and out of order, GQA ratios 1, 2 and 4, fp32 and bf16; then the whole
model runner with the kernel against the runner without it.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from minedraft.model.attention import attend, plan_attention  # noqa: E402
from minedraft.model.kernels.triton_attention import paged_attention, paged_meta, supports  # noqa: E402
from minedraft.model.kv_cache import NULL_BLOCK  # noqa: E402
from minedraft.model.runner import ModelRunner  # noqa: E402

from tiny_models import assert_runners_agree, make_tiny_checkpoint  # noqa: E402

BLOCK_SIZE, HEAD_DIM = 16, 32
CPU = torch.device("cpu")


def _batch(seed: int) -> tuple[list[int], list[int], list[list[int]], int]:
    """(starts, lengths, block tables, pool blocks): decode at every context length around one and two
    blocks, a k + 1 window, a fresh prompt, a chunk after a prefix; each sequence's blocks drawn at
    random from a pool with blocks nobody uses (holes), so tables are out of order."""
    rng = random.Random(seed)
    shapes = [(n, 1) for n in range(1, BLOCK_SIZE + 2)] + [(2 * BLOCK_SIZE, 1), (23, 5), (0, 40), (37, 19)]
    blocks_needed = [-(-(start + length) // BLOCK_SIZE) for start, length in shapes]
    pool = list(range(1, sum(blocks_needed) + len(shapes) + 1))  # block 0 is the zero block
    rng.shuffle(pool)
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(pool[used : used + n])
        used += n + rng.choice([0, 1])  # leave holes
    return [s for s, _ in shapes], [n for _, n in shapes], tables, len(pool) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_kernel_matches_the_reference_attention(heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    starts, lengths, tables, num_blocks = _batch(seed=heads * kv_heads)
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, BLOCK_SIZE, HEAD_DIM, generator=gen).to(dtype)
                        for _ in range(2))  # fmt: skip
    q = torch.randn(sum(lengths), heads, HEAD_DIM, generator=gen).to(dtype)
    plan = plan_attention(starts, lengths, tables, BLOCK_SIZE, heads, kv_heads, CPU, batch_invariant=False)
    expected = attend(q.float(), k_cache.float(), v_cache.float(), plan, HEAD_DIM**-0.5)
    got = paged_attention(q, k_cache, v_cache, paged_meta(starts, lengths, tables, NULL_BLOCK, CPU), HEAD_DIM**-0.5)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("partition", [32, 64, 128])
def test_partitions_of_a_long_context_merge_to_the_reference(partition: int) -> None:
    """Contexts past one partition are read by one program per partition and merged; k + 1 windows that
    straddle a partition's end (a row that sees no key of the last partition), a partition smaller than
    the kernel's 64-key step, decode next to a long prefill chunk (after a prefix, its 40 rows across the
    boundary of every partition size here: under Triton's interpreter each (token, head) row is a program of the
    merge, so the chunk is as long as it needs to be)."""
    heads, kv_heads, dtype = 8, 2, torch.bfloat16
    shapes = [(300, 1), (127, 5), (128, 1), (60, 8), (250, 17), (100, 40), (31, 2)]
    starts, lengths = [s for s, _ in shapes], [n for _, n in shapes]
    rng = random.Random(partition)
    pool = list(range(1, 200))
    rng.shuffle(pool)
    tables, used = [], 0
    for start, length in shapes:
        need = -(-(start + length) // BLOCK_SIZE)
        tables.append(pool[used : used + need])
        used += need
    gen = torch.Generator().manual_seed(partition)
    k_cache, v_cache = (torch.randn(kv_heads, 200, BLOCK_SIZE, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(sum(lengths), heads, HEAD_DIM, generator=gen).to(dtype)
    plan = plan_attention(starts, lengths, tables, BLOCK_SIZE, heads, kv_heads, CPU, batch_invariant=False)
    expected = attend(q.float(), k_cache.float(), v_cache.float(), plan, HEAD_DIM**-0.5)
    meta = paged_meta(starts, lengths, tables, NULL_BLOCK, CPU)
    got = paged_attention(q, k_cache, v_cache, meta, HEAD_DIM**-0.5, partition=partition)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    one_partition = paged_attention(q, k_cache, v_cache, meta, HEAD_DIM**-0.5, partition=512)
    torch.testing.assert_close(got.float(), one_partition.float(), atol=2e-2, rtol=2e-2)  # bf16 rounding


def test_a_rows_merge_does_not_depend_on_the_longest_sequence_beside_it() -> None:
    """A batch's longest sequence sets how many partitions every sequence is merged over (the extra ones
    empty for the shorter): a decode row and a k + 1 window give the same bits alone and beside a sequence
    of four times their partitions."""
    heads, kv_heads, partition = 8, 2, 32
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(kv_heads, 64, BLOCK_SIZE, HEAD_DIM, generator=gen) for _ in range(2))
    short = ([70, 60], [1, 5], [list(range(1, 6)), list(range(6, 11))])
    q_short = torch.randn(6, heads, HEAD_DIM, generator=gen)
    alone = paged_attention(q_short, k_cache, v_cache, paged_meta(*short, NULL_BLOCK, CPU), 0.2, partition=partition)
    starts, lengths, tables = short[0] + [400], short[1] + [1], short[2] + [list(range(11, 37))]
    q = torch.cat((q_short, torch.randn(1, heads, HEAD_DIM, generator=gen)))
    beside = paged_attention(q, k_cache, v_cache, paged_meta(starts, lengths, tables, NULL_BLOCK, CPU), 0.2,
                             partition=partition)  # fmt: skip
    assert torch.equal(beside[:6], alone)


def test_nothing_past_a_sequence_is_read() -> None:
    """Poison every cache slot outside the sequences (other blocks, and the tail of each last block, where
    an earlier sequence's keys may linger): no output may change."""
    starts, lengths, tables, num_blocks = _batch(seed=3)
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(2, num_blocks, BLOCK_SIZE, HEAD_DIM, generator=gen) for _ in range(2))
    q = torch.randn(sum(lengths), 4, HEAD_DIM, generator=gen)
    meta = paged_meta(starts, lengths, tables, NULL_BLOCK, CPU)
    clean = paged_attention(q, k_cache, v_cache, meta, 0.2)
    live = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.bool)
    for start, length, table in zip(starts, lengths, tables, strict=True):
        live[[table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start + length)]] = True
    for cache in (k_cache, v_cache):
        cache.view(2, -1, HEAD_DIM)[:, ~live] = float("nan")
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.2), clean)


def test_the_runner_with_the_kernel_matches_the_runner_without(tmp_path) -> None:
    """Prefill, decode and a verification window, several sequences at once, through every layer."""
    path = make_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3", hidden_size=64, num_layers=2, seed=4)
    runners = {kernel: ModelRunner(path, max_seq_len=96, num_slots=3, attention_kernel=kernel)
               for kernel in ("torch", "triton")}  # fmt: skip
    assert runners["triton"].paged_kernel and not runners["torch"].paged_kernel
    assert_runners_agree(runners["triton"], runners["torch"], tolerance=1e-4)


def test_kernel_choice(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3", hidden_size=64, num_layers=1, seed=4)
    assert not ModelRunner(path, max_seq_len=32).paged_kernel  # auto: torch's kernels on CPU
    with pytest.raises(ValueError, match="attention_kernel triton is not the strict mode.s kernel"):
        ModelRunner(path, max_seq_len=32, batch_invariant=True, attention_kernel="triton")
    with pytest.raises(ValueError, match="attention_kernel .flash.: use auto, torch, triton or cpu"):
        ModelRunner(path, max_seq_len=32, attention_kernel="flash")
    assert supports(16, 64) and supports(32, 128)
    assert not supports(8, 64) and not supports(24, 64) and not supports(16, 8)
