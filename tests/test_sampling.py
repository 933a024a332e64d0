"""Logits processing (temperature, top-k, top-p) and draft sampling."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from minedraft.sampling.params import SamplingParams
from minedraft.sampling.sampler import (
    SparseProbs,
    _threshold_among_candidates,
    draft_sample,
    processed_probs,
    row_argmax,
)
from minedraft.sampling.streams import DRAFT, FINAL, RowKeys, seed_tensor, uniforms

from conftest import target_probs

# p = [0.1, 0.2, 0.3, 0.4]: hand-checkable top-k / top-p cut-offs.
LOGITS_1234 = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))


def probs_of(logits: torch.Tensor, *args: float, **kwargs: float) -> list[float]:
    return target_probs(logits, SamplingParams(*args, **kwargs))[0].tolist()


def dense(q: SparseProbs, vocab_size: int) -> torch.Tensor:
    """[n, vocab_size]: each row's sparse draft distribution spread over the vocabulary."""
    return torch.zeros(len(q), vocab_size).scatter_add_(1, q.token_ids, q.probs.float())


def draws(seeds: list[int], positions: list[int] | None = None) -> torch.Tensor:
    """One uniform per row, keyed by (seed, position) as the workers key theirs."""
    keys = RowKeys.of(seeds, positions if positions is not None else [0] * len(seeds))
    return keys.draw(FINAL, torch.device("cpu"))


def test_temperature_scales_logits() -> None:
    logits = torch.log(torch.tensor([[1.0, 2.0, 4.0]]))
    assert probs_of(logits, 1.0) == pytest.approx([1 / 7, 2 / 7, 4 / 7])
    # T = 2: probabilities proportional to sqrt of the originals.
    root = [1.0, math.sqrt(2.0), 2.0]
    assert probs_of(logits, 2.0) == pytest.approx([x / sum(root) for x in root])
    # T = 0.5: squares.
    assert probs_of(logits, 0.5) == pytest.approx([1 / 21, 4 / 21, 16 / 21])


def test_top_k() -> None:
    assert probs_of(LOGITS_1234, 1.0, top_k=2) == pytest.approx([0, 0, 3 / 7, 4 / 7])
    assert probs_of(LOGITS_1234, 1.0, top_k=1) == pytest.approx([0, 0, 0, 1])
    assert probs_of(LOGITS_1234, 1.0, top_k=10) == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert probs_of(logits, 1.0, top_k=1) == pytest.approx([0, 0.5, 0.5, 0])


def test_top_p_keeps_smallest_prefix_reaching_the_mass() -> None:
    assert probs_of(LOGITS_1234, 1.0, top_p=0.35) == pytest.approx([0, 0, 0, 1])
    assert probs_of(LOGITS_1234, 1.0, top_p=0.5) == pytest.approx([0, 0, 3 / 7, 4 / 7])
    assert probs_of(LOGITS_1234, 1.0, top_p=0.75) == pytest.approx([0, 2 / 9, 3 / 9, 4 / 9])
    assert probs_of(LOGITS_1234, 1.0, top_p=0.95) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    # Always at least one token, however small top_p is.
    assert probs_of(LOGITS_1234, 1.0, top_p=1e-6) == pytest.approx([0, 0, 0, 1])


def test_top_p_keeps_ties_with_the_last_kept_value() -> None:
    # [1/8, 1/8, 1/4, 1/2] with top_p = 0.8 needs one of the 1/8s; equal values are kept together.
    logits = torch.log(torch.tensor([[0.125, 0.125, 0.25, 0.5]]))
    assert probs_of(logits, 1.0, top_p=0.8) == pytest.approx([0.125, 0.125, 0.25, 0.5])
    assert probs_of(logits, 1.0, top_p=0.6) == pytest.approx([0, 0, 1 / 3, 2 / 3])


def test_top_p_applies_after_temperature_and_top_k() -> None:
    # After top-k = 2 the survivors are [3/7, 4/7]; 4/7 >= 0.55 alone. (Top-p first would keep both.)
    assert probs_of(LOGITS_1234, 1.0, top_k=2, top_p=0.55) == pytest.approx([0, 0, 0, 1])
    # At T = 0.5 p = [1, 4, 9, 16] / 30: 16/30 < 0.6 <= 25/30.
    assert probs_of(LOGITS_1234, 0.5, top_p=0.6) == pytest.approx([0, 0, 9 / 25, 16 / 25])


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_a_narrow_cut_sorts_only_its_candidates_and_keeps_what_a_full_sort_keeps(ties: bool) -> None:
    """A top-k far below the vocabulary, or a top-p whose mass the largest logits reach, sorts only those; a
    row with a wide top-k sorts them all. Each row is processed on its own, so a row's result must not depend
    on which way its batch went. Logits of three values tie at the k-th value far beyond the candidates: then
    the whole vocabulary is sorted."""
    torch.manual_seed(0)
    logits = (torch.randn(7, 4096) * 0.3).round() if ties else torch.randn(7, 4096) * 4
    narrow = [SamplingParams(0.9, top_k=k, top_p=p) for k, p in [(1, 1), (5, 1), (20, 0.9), (40, 0.5), (7, 0.8),
                                                                   (-1, 0.9), (-1, 0.5)]]  # fmt: skip
    top_k = torch.tensor([p.top_k if p.top_k > 0 else 4096 for p in narrow])
    top_p = torch.tensor([p.top_p for p in narrow], dtype=torch.float64)
    _, found = _threshold_among_candidates(logits / 0.9, top_k, top_p)
    assert found.tolist() == [not ties] * 7
    alone = processed_probs(logits, narrow)
    wide = SamplingParams(0.9, top_k=3000)
    beside_a_full_sort = processed_probs(torch.cat([logits, logits[:1]]), [*narrow, wide])[:7]
    assert torch.equal(alone > 0, beside_a_full_sort > 0)
    torch.testing.assert_close(alone, beside_a_full_sort)
    for row, k in [(0, 1), (1, 5)]:  # top-k alone keeps the k largest and every tie of the k-th
        assert int((alone[row] > 0).sum()) == int((logits[row] >= logits[row].topk(k).values[-1]).sum())


def test_top_p_over_a_large_vocabulary_matches_huggingface() -> None:
    """Top-p alone, its cut among the largest logits (the candidates) or beyond them (a full sort)."""
    warpers = pytest.importorskip("transformers.generation.logits_process")
    torch.manual_seed(1)
    for scale, top_p in [(4.0, 0.9), (4.0, 0.3), (0.5, 0.95)]:  # 0.5: a flat row, whose cut lies far out
        logits = torch.randn(4, 4096) * scale
        expected = warpers.TopPLogitsWarper(top_p)(None, logits / 0.8).softmax(-1)
        ours = target_probs(logits, SamplingParams(0.8, top_p))
        torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
        assert torch.equal(ours > 0, expected > 0)


def test_matches_huggingface_warpers() -> None:
    warpers = pytest.importorskip("transformers.generation.logits_process")
    torch.manual_seed(0)
    for _ in range(15):
        vocab = int(torch.randint(5, 200, ()))
        logits = torch.randn(3, vocab) * 3
        temp = float(torch.rand(())) * 2 + 0.1
        top_k = int(torch.randint(1, vocab + 3, ()))
        top_p = float(torch.rand(())) * 0.98 + 0.01
        for k, p in [(top_k, 1.0), (-1, top_p), (top_k, top_p)]:
            expected = logits / temp
            if k > 0:
                expected = warpers.TopKLogitsWarper(k)(None, expected)
            if p < 1:
                expected = warpers.TopPLogitsWarper(p)(None, expected)
            ours = target_probs(logits, SamplingParams(temp, p, k))
            torch.testing.assert_close(ours, expected.softmax(-1), atol=1e-6, rtol=1e-5)
            assert torch.equal(ours > 0, expected > -math.inf)


def test_greedy_is_one_hot_at_first_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 2.0, 0.0]])
    probs = target_probs(logits, SamplingParams(0.0, top_k=2, top_p=0.1))
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_rows_with_different_params_are_processed_independently() -> None:
    logits = LOGITS_1234.repeat(3, 1)
    params = [SamplingParams(1.0, top_k=2), SamplingParams(0.0), SamplingParams(0.5)]
    probs = processed_probs(logits, params)
    assert probs[0].tolist() == pytest.approx([0, 0, 3 / 7, 4 / 7])
    assert probs[1].tolist() == [0, 0, 0, 1]
    assert probs[2].tolist() == pytest.approx([1 / 30, 4 / 30, 9 / 30, 16 / 30])


def test_draft_sample_truncates_and_renormalises() -> None:
    vocab, support = 10, 3
    logits = torch.log(torch.arange(1, vocab + 1, dtype=torch.float32) / 55).repeat(400, 1)
    params = [SamplingParams(1.0)] * 400
    tokens, token_probs, q = draft_sample(logits, params, draws(list(range(400))), support)
    assert q.token_ids.shape == q.probs.shape == (400, support)
    assert q.token_ids[0].tolist() == [9, 8, 7]
    assert q.probs[0].tolist() == pytest.approx([10 / 27, 9 / 27, 8 / 27])
    assert set(tokens) == {7, 8, 9}  # always inside the support, and all of it is reached
    for token, prob in zip(tokens, token_probs):
        assert prob == pytest.approx((token + 1) / 27)  # q(chosen) under the truncated q
    torch.testing.assert_close(q.probs.sum(-1), torch.ones(400))


def test_draft_sample_applies_request_params_before_truncating() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    _, _, q = draft_sample(logits, [SamplingParams(1.0, top_k=2)], draws([0]), 3)
    # Top-k leaves two tokens; the third support entry is padding with probability 0.
    assert q.probs[0].tolist() == pytest.approx([4 / 7, 3 / 7, 0])
    assert q.token_ids[0, :2].tolist() == [3, 2]


def test_draft_sample_greedy_rows_and_padding() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [1.0, 0.0, 0.5]])
    params = [SamplingParams(0.0), SamplingParams(1.0)]
    tokens, token_probs, q = draft_sample(logits, params, draws([0, 1]), support_size=5)
    assert tokens[0] == 1
    assert token_probs[0] == pytest.approx(logits[0].softmax(-1)[1].item())
    assert q.probs.shape == q.token_ids.shape == (2, 5)
    assert dense(q, 3)[0].tolist() == [0, 1, 0]
    # Support larger than the vocabulary: padded, and densifies back to the full distribution.
    torch.testing.assert_close(dense(q, 3)[1], logits[1].softmax(-1))
    assert token_probs[1] == pytest.approx(logits[1].softmax(-1)[tokens[1]].item())


def test_draft_sample_seeded_rows_are_batch_independent() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, 500)
    params = [SamplingParams(1.0), SamplingParams(0.0), SamplingParams(0.7, 0.95)]
    batch = draft_sample(logits, params, draws([5, 0, 6], [2, 0, 9]), 16)
    alone = draft_sample(logits[2:], params[2:], draws([6], [9]), 16)
    assert batch[0][2] == alone[0][0]
    assert batch[1][2] == alone[1][0]
    assert torch.equal(batch[2].probs[2], alone[2].probs[0])


def test_sparse_probs_helpers() -> None:
    q = SparseProbs(torch.tensor([[2, 0, 0], [1, 3, 3]]), torch.tensor([[0.75, 0.25, 0.0], [0.5, 0.5, 0.0]]))
    assert len(q) == 2 and q.support_size == 3
    assert dense(q, 4).tolist() == [[0.25, 0, 0.75, 0], [0, 0.5, 0, 0.5]]
    both = SparseProbs.cat([q[1], q[0]])
    assert both.token_ids.tolist() == [[1, 3, 3], [2, 0, 0]]
    assert q[-1].token_ids.tolist() == [[1, 3, 3]]
    assert q[torch.tensor([1])].probs.tolist() == [[0.5, 0.5, 0.0]]
    assert dense(SparseProbs.one_hot(torch.tensor([4, 1])), 5).tolist() == [[0, 0, 0, 0, 1], [0, 1, 0, 0, 0]]
    with pytest.raises(ValueError):
        SparseProbs(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 2))


def test_batch_sizes_must_agree() -> None:
    logits = torch.randn(2, 5)
    with pytest.raises(ValueError):
        draft_sample(logits, [SamplingParams(1.0)], draws([0, 0]), 3)
    with pytest.raises(ValueError):
        draft_sample(logits, [SamplingParams(1.0)] * 2, draws([0]), 3)
    with pytest.raises(ValueError):
        draft_sample(logits, [SamplingParams(1.0)] * 2, draws([0, 0]), 0)


def _splitmix_reference(seed: int, stream: int, position: int, counter: int) -> float:
    """The keyed draw in plain Python integers (mod 2^64), to check the int64 tensor version."""
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    x = mix((seed & mask) ^ ((stream * 0x9E3779B97F4A7C15) & mask))
    x = mix(x ^ position)
    x = mix(x ^ counter)
    return (x >> 11) * 2.0**-53


def test_keyed_uniforms_match_the_reference_and_are_uniform() -> None:
    seeds, positions, counters = [0, 1, 2**63 + 5, -3, 2**64 - 1], [0, 7, 99, 3, 2**40], [1, 2, 3, 0, 5]
    got = uniforms(seed_tensor(seeds), DRAFT, torch.tensor(positions), torch.tensor(counters)).tolist()
    assert got == [_splitmix_reference(*key) for key in zip(seeds, [DRAFT] * 5, positions, counters)]
    # One request's positions, and one position over many seeds: both look uniform (KS test).
    along = uniforms(seed_tensor([42]), FINAL, torch.arange(50_000))
    across = uniforms(seed_tensor(list(range(50_000))), FINAL, torch.tensor(3))
    for sample in (along, across):
        assert ((sample >= 0) & (sample < 1)).all()
        assert stats.kstest(sample.numpy(), "uniform").pvalue > 1e-4
    # Streams of one key are not the same numbers.
    assert not torch.equal(along, uniforms(seed_tensor([42]), DRAFT, torch.arange(50_000)))


def test_row_argmax_is_torchs_argmax() -> None:
    """The numpy path on CPU picks what torch's argmax picks: the first of equal maxima, a NaN as the largest,
    an all -inf row its first index; strided rows; other dtypes go to torch."""
    rows = torch.tensor([[1.0, 3.0, 3.0, float("nan"), 2.0], [float("-inf")] * 5, [2.0, 2.0, 1.0, 0.0, 2.0],
                         [0.5, float("nan"), 9.0, float("nan"), 1.0]])  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    for logits in (rows, torch.randn(40, 4096, generator=generator), torch.randn(6, 300, generator=generator)[:, ::3],
                   torch.randn(3, 50, generator=generator).double(), torch.randn(0, 9)):
        assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
        assert row_argmax(logits).dtype == torch.int64
    half = torch.randn(4, 33, generator=generator).to(torch.bfloat16)
    assert torch.equal(row_argmax(half), half.argmax(dim=-1))
