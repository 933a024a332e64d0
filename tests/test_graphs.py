"""CUDA graphs' fixed-shape forward, without a GPU: buckets, padding and buffer reuse.

A graph replays one bucket's forward at a fixed size, so a step's inputs are padded. These tests run
that padded forward (model/graphs.StaticForward, the paged kernel under Triton's interpreter) against the
eager forward on the same steps: equal logits for every real row and equal keys and values in every
block a sequence holds. Capture and replay themselves need a CUDA device (benchmarks/gpu_suite.py).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from minedraft.model.graphs import MAX_QUERY, StaticForward, capture_sizes, pick_bucket  # noqa: E402
from minedraft.model.runner import ModelRunner, SeqInput  # noqa: E402

from tiny_models import make_tiny_checkpoint  # noqa: E402


@pytest.mark.parametrize(("max_tokens", "expected"), [
    (1, [1]),
    (6, [1, 2, 4, 6]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    (300, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256, 300]),
    (512, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]),
])  # fmt: skip
def test_capture_sizes(max_tokens: int, expected: list[int]) -> None:
    assert capture_sizes(max_tokens) == expected


@pytest.mark.parametrize(("tokens", "bucket"), [(1, 1), (3, 4), (8, 8), (9, 16), (57, 64), (65, None)])
def test_pick_bucket(tokens: int, bucket: int | None) -> None:
    assert pick_bucket(capture_sizes(64), tokens) == bucket


@pytest.fixture(scope="module")
def runners(tmp_path_factory) -> tuple[ModelRunner, ModelRunner, StaticForward]:
    """Two runners over one checkpoint with the paged kernel, keeping the features EAGLE heads read (layer
    inputs for EAGLE-3, the final normed state, 2, for EAGLE-1); the second runs every step it can through the
    fixed-shape forward (buckets up to 24 tokens)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), arch="qwen3", hidden_size=64, num_layers=2,
                                seed=6)  # fmt: skip
    eager, padded = (ModelRunner(path, max_seq_len=96, num_slots=4, attention_kernel="triton",
                                 aux_hidden_layers=(1, 0, 2)) for _ in range(2))  # fmt: skip
    padded.graphs = StaticForward(padded.model, padded.kv_cache, padded.max_seq_len, padded.device, max_tokens=24)
    return eager, padded, padded.graphs


def _held_kv(runner: ModelRunner, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the tokens the sequence holds, in order (layer 0)."""
    cache, length = runner.kv_cache, runner.kv_cache.lengths[slot]
    index = torch.tensor(cache.token_index(slot, 0, length))
    flat = lambda pool: pool.view(pool.shape[0], -1, pool.shape[-1])[:, index]  # noqa: E731
    return flat(cache.k[0]), flat(cache.v[0])


def test_padded_steps_match_eager_steps(runners) -> None:
    """Prefill (eager in both: its queries are too long), then decode and verification steps through the
    buckets of 4, 8, 16 and 24 tokens, several buckets reused by different batches."""
    eager, padded, static = runners
    rng = random.Random(1)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (5, 17, 33, 2)]
    for runner in (eager, padded):
        for _ in prompts:
            runner.allocate_slot()
    lengths = [len(p) for p in prompts]
    steps = [[SeqInput(i, p, 0) for i, p in enumerate(prompts)]]
    for width in (1, 2, 4, 1, 7, 3, 1):  # decode (1) and verification windows (k + 1)
        steps.append([SeqInput(i, [rng.randrange(320) for _ in range(width)], lengths[i], num_logits=width)
                      for i in range(len(prompts)) if (i + width) % 3])  # fmt: skip
        for seq in steps[-1]:
            lengths[seq.slot] += width - 1  # all but the last token accepted: the next step writes from there
    used = set()
    for step in steps:
        batch = padded.prepare(step)
        if static.fits(batch):
            used.add(pick_bucket(static.sizes, len(batch.input_ids)))
        torch.testing.assert_close(padded.forward(step), eager.forward(step), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(padded.aux_hidden, eager.aux_hidden, atol=1e-5, rtol=1e-5)  # real tokens only
    assert used == {4, 8, 16, 24} and set(static.buffers) == used, "the steps are meant to cover these buckets"
    for slot in range(len(prompts)):
        for ours, theirs in zip(_held_kv(padded, slot), _held_kv(eager, slot)):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_what_the_buckets_do_not_cover_runs_eagerly(runners) -> None:
    eager, padded, static = runners
    slot = padded.allocate_slot()
    long_query = padded.prepare([SeqInput(slot, list(range(MAX_QUERY + 1)), 0)])
    assert not static.fits(long_query), "a prefill chunk's query is longer than a graph's grid"
    many = [padded.allocate_slot() for _ in range(2)]
    too_many = padded.prepare([SeqInput(s, list(range(13)), 0) for s in many])
    assert not static.fits(too_many), "26 tokens: past the largest bucket"


def test_padding_writes_only_the_scratch_block(runners) -> None:
    """Padding tokens write their keys to the scratch block, never to the zero block or a real one."""
    _, padded, static = runners
    slot = padded.allocate_slot()
    padded.forward([SeqInput(slot, [1, 2, 3], 0)])  # eager prefill of 3 tokens... then one decode token
    zero_before = padded.kv_cache.k[0][:, 0].clone()
    padded.forward([SeqInput(slot, [4], 3)])  # 1 token: the 1-token bucket, no padding
    padded.forward([SeqInput(slot, [5, 6, 7], 4, num_logits=3)])  # 3 tokens in the 4-token bucket: 1 padding
    assert torch.equal(padded.kv_cache.k[0][:, 0], zero_before)
    assert static.buffers[4].token_index[3] == padded.kv_cache.scratch_block * padded.kv_cache.block_size
