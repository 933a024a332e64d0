"""The C paged-attention kernel for CPU (model/kernels/cpu_attention.py) against the torch path we already trust.

Built for real with this machine's C compiler, as a user's first start builds it. Cases: decode at every
context length around block boundaries, k + 1 verification windows, short prompts, block tables out of
order with holes, cache blocks of 8, 16 and 32 tokens, GQA ratios 1, 2 and 4 (rows scored key by key and
against transposed keys), head sizes 32, 64 and 128; a batch mixing short and long queries
(long ones stay on sdpa); nothing outside a sequence is read; a sequence's rows are bit-identical alone
and in any batch; the whole runner with the kernel against the runner without it; the kernel choice and
its refusals, and the fallback where no compiler runs.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from minedraft.model.attention import attend, plan_attention
from minedraft.model.kernels import cpu_attention
from minedraft.model.kv_cache import NULL_BLOCK
from minedraft.model.runner import ModelRunner

from tiny_models import assert_runners_agree, make_tiny_checkpoint, torch_threads

BLOCK_SIZE = 16
CPU = torch.device("cpu")


def _shapes_and_tables(shapes: list[tuple[int, int]], seed: int,
                       block_size: int = BLOCK_SIZE) -> tuple[list[int], list[int], list[list[int]], int]:
    """(starts, lengths, block tables, pool blocks) for (start, length) shapes: each sequence's blocks drawn
    at random from a pool with unused blocks between them, so tables are out of order and have holes."""
    rng = random.Random(seed)
    needed = [-(-(start + length) // block_size) for start, length in shapes]
    pool = list(range(1, sum(needed) + len(shapes) + 1))  # block 0 is the zero block
    rng.shuffle(pool)
    tables, used = [], 0
    for n in needed:
        tables.append(pool[used : used + n])
        used += n + rng.choice([0, 1])
    return [s for s, _ in shapes], [n for _, n in shapes], tables, len(pool) + 1


SHORT = [(n, 1) for n in range(0, 2 * BLOCK_SIZE + 2)] + [(23, 5), (47, 5), (0, 7), (15, 32), (100, 3)]


def _attention(shapes, heads: int, kv_heads: int, head_dim: int, seed: int, cpu_kernel: bool,
               poison: bool = False, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    starts, lengths, tables, num_blocks = _shapes_and_tables(shapes, seed, block_size)
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen) for _ in range(2))
    q = torch.randn(sum(lengths), heads, head_dim, generator=gen)
    if poison:  # every slot no sequence holds (other blocks, the tails of last blocks) is NaN
        live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for start, length, table in zip(starts, lengths, tables, strict=True):
            live[[table[p // block_size] * block_size + p % block_size for p in range(start + length)]] = True
        for cache in (k_cache, v_cache):
            cache.view(kv_heads, -1, head_dim)[:, ~live] = float("nan")
    plan = plan_attention(starts, lengths, tables, block_size, heads, kv_heads, CPU, batch_invariant=False,
                          cpu_kernel=cpu_kernel)  # fmt: skip
    assert (plan.cpu is not None) == cpu_kernel
    return attend(q, k_cache, v_cache, plan, head_dim**-0.5)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_kernel_matches_the_torch_path(heads: int, kv_heads: int, head_dim: int) -> None:
    expected = _attention(SHORT, heads, kv_heads, head_dim, seed=heads + head_dim, cpu_kernel=False)
    got = _attention(SHORT, heads, kv_heads, head_dim, seed=heads + head_dim, cpu_kernel=True)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("block_size", [8, 32])
def test_cache_blocks_smaller_and_larger_than_the_kernels_chunk_of_keys(block_size: int) -> None:
    """The kernel reads up to 16 keys at a time and never across a block's end."""
    for heads, kv_heads in ((4, 4), (4, 2)):  # four rows a step (keys transposed) and two (key by key)
        expected = _attention(SHORT, heads, kv_heads, 64, seed=7, cpu_kernel=False, block_size=block_size)
        got = _attention(SHORT, heads, kv_heads, 64, seed=7, cpu_kernel=True, block_size=block_size)
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)
        poisoned = _attention(SHORT, heads, kv_heads, 64, seed=7, cpu_kernel=True, poison=True, block_size=block_size)
        assert torch.equal(poisoned, got)


def test_a_batch_of_short_and_long_queries_splits_between_the_kernel_and_sdpa() -> None:
    shapes = [(40, 1), (0, 90), (17, 5), (33, 40), (5, 1)]  # 90 and 40 new tokens: sdpa's calls
    expected = _attention(shapes, 8, 2, 64, seed=5, cpu_kernel=False)
    got = _attention(shapes, 8, 2, 64, seed=5, cpu_kernel=True)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


def test_long_queries_run_on_torchs_flash_kernel_and_a_chunk_equals_its_rows_of_the_whole_prompt() -> None:
    """Prompts (queries over PADDED_MAX_QUERY) take sdpa's calls, on torch's CPU flash kernel (its math fallback,
    taken for inputs without a batch dimension, was 2.2x slower on a 130-token prompt). A chunk of a prompt
    (prefix caching, chunked prefill: a mask) gives its rows of the whole prompt's (causal) bit for bit, so a
    prompt read from the cache decodes as one prefilled in full."""
    heads, kv_heads, head_dim = 8, 2, 64
    starts, lengths, tables, num_blocks = _shapes_and_tables([(0, 90)], seed=11)
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=gen) for _ in range(2))
    q = torch.randn(90, heads, head_dim, generator=gen)

    def run(start: int) -> torch.Tensor:
        plan = plan_attention([start], [90 - start], tables, BLOCK_SIZE, heads, kv_heads, CPU, batch_invariant=False)
        return attend(q[start:], k_cache, v_cache, plan, head_dim**-0.5)

    with torch.profiler.profile() as profile:
        whole, chunk = run(0), run(40)
    ops = {event.name for event in profile.events()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops
    assert torch.equal(chunk, whole[40:])
    strict = plan_attention([0], [90], tables, BLOCK_SIZE, heads, kv_heads, CPU, batch_invariant=True)
    torch.testing.assert_close(whole, attend(q, k_cache, v_cache, strict, head_dim**-0.5), atol=2e-6, rtol=2e-5)


def test_nothing_outside_a_sequence_is_read() -> None:
    clean = _attention(SHORT, 8, 2, 64, seed=9, cpu_kernel=True)
    poisoned = _attention(SHORT, 8, 2, 64, seed=9, cpu_kernel=True, poison=True)
    assert torch.equal(poisoned, clean)


def test_a_sequences_rows_are_the_same_alone_and_in_any_batch() -> None:
    """Bit for bit: the kernel computes a row by the same loop whatever else the call holds (unlike the
    padded sdpa call, whose padding depends on the batch)."""
    heads, kv_heads, dim = 8, 2, 64
    starts, lengths, tables, num_blocks = _shapes_and_tables(SHORT, seed=11)
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, BLOCK_SIZE, dim, generator=gen) for _ in range(2))
    q = torch.randn(sum(lengths), heads, dim, generator=gen)
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]

    def run(seqs: list[int], threads: int) -> torch.Tensor:
        rows = torch.cat([torch.arange(offsets[i], offsets[i] + lengths[i]) for i in seqs])
        meta = cpu_attention.cpu_paged_meta([starts[i] for i in seqs],
                                            [sum(lengths[j] for j in seqs[:n]) for n in range(len(seqs))],
                                            [lengths[i] for i in seqs], [tables[i] for i in seqs], NULL_BLOCK)
        out = torch.empty(len(rows), heads, dim)
        with torch_threads(threads):
            cpu_attention.paged_attention(q[rows], k_cache, v_cache, meta, 0.125, out)
        return out

    everyone = run(list(range(len(SHORT))), threads=2)
    for i in (0, 16, 33, len(SHORT) - 1):
        assert torch.equal(run([i], threads=1), everyone[offsets[i] : offsets[i] + lengths[i]])
    some = [5, 34, 2]
    assert torch.equal(run(some, threads=1)[lengths[5] :], torch.cat([everyone[offsets[i] : offsets[i] + lengths[i]]
                                                                       for i in some[1:]]))  # fmt: skip


def test_the_runner_with_the_kernel_matches_the_runner_without(tmp_path) -> None:
    """Prefill, decode and a verification window, several sequences at once, through every layer; auto is
    the kernel on CPU."""
    path = make_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3", hidden_size=64, num_layers=2, seed=4)
    runners = {kernel: ModelRunner(path, max_seq_len=96, num_slots=3, attention_kernel=kernel)
               for kernel in ("torch", "auto")}  # fmt: skip
    assert runners["auto"].cpu_kernel and not runners["torch"].cpu_kernel
    assert_runners_agree(runners["auto"], runners["torch"], tolerance=1e-5)


def test_kernel_choice_and_refusals(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3", hidden_size=64, num_layers=1, seed=4)
    assert ModelRunner(path, max_seq_len=32, attention_kernel="cpu").cpu_kernel
    assert not ModelRunner(path, max_seq_len=32, batch_invariant=True).cpu_kernel  # the strict mode keeps its own
    assert not ModelRunner(path, max_seq_len=32, dtype=torch.bfloat16).cpu_kernel
    with pytest.raises(ValueError, match="attention_kernel cpu is not the strict mode's kernel"):
        ModelRunner(path, max_seq_len=32, batch_invariant=True, attention_kernel="cpu")
    with pytest.raises(ValueError, match="attention_kernel cpu runs float32 models on CPU .* not dtype torch.bfloat16"):
        ModelRunner(path, max_seq_len=32, dtype=torch.bfloat16, attention_kernel="cpu")


def test_without_a_compiler_auto_keeps_the_torch_path_and_cpu_refuses(tmp_path) -> None:
    """A fresh cache and CC naming no compiler, in a process of its own (the build is cached per process)."""
    path = make_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3", hidden_size=64, num_layers=1, seed=4)
    script = textwrap.dedent(f"""
        import pytest
        from minedraft.model.runner import ModelRunner
        assert not ModelRunner({str(path)!r}, max_seq_len=32).cpu_kernel
        with pytest.raises(ValueError, match="attention_kernel cpu: no C compiler: 'no-such-cc' is not on PATH"):
            ModelRunner({str(path)!r}, max_seq_len=32, attention_kernel="cpu")
    """)
    env = {**os.environ, "CC": "no-such-cc", "MINEDRAFT_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "attention stays on torch's sdpa path (no C compiler" in done.stderr


def test_a_kernel_choice_is_timed_once_per_machine_and_timed_again_when_unreadable(tmp_path, monkeypatch) -> None:
    from minedraft.model.kernels.cpu_kernels import remembered

    monkeypatch.setenv("MINEDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    timings = []

    def measure(verdict: bool):
        return lambda: timings.append(verdict) or verdict

    assert remembered("choice", measure(True)) is True
    assert remembered("choice", measure(False)) is True  # kept: not timed again
    assert remembered("other-torch", measure(False)) is False  # another key is another verdict
    (kept,) = (tmp_path / "cache" / "verdicts").glob("choice-*.json")
    kept.write_text("{not json")
    assert remembered("choice", measure(False)) is False
    assert timings == [True, False, False]
