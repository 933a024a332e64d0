"""Rejection sampling: exact greedy verification and statistically checked losslessness.

Statistical tests: each case replicates a few request "slots" over many trials in one batch. A slot
has fixed target logits per position, independent of the prefix, so every output position i that a
trial reaches must be distributed exactly as the processed target p_i; a chi-square goodness-of-fit
test compares the empirical counts with p_i. Drafts are drawn in the test from a draft distribution
q that deliberately differs from p.

Threshold: a correct sampler fails one chi-square test with probability ALPHA = 1e-4, and this file
runs fewer than 40 of them, so a fresh seed would raise a false alarm with probability < 0.4%; the
seeds are fixed, so the outcome is deterministic anyway. The tests have power: the same check rejects
a sampler that skips the residual (p-values < 1e-10) and a verifier that uses the untruncated q.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from scipy import stats

from minedraft.sampling import rejection
from minedraft.sampling.params import SamplingParams
from minedraft.sampling.rejection import rejection_sample
from minedraft.sampling.sampler import SparseProbs, draft_sample
from minedraft.sampling.streams import DRAFT, RowKeys

from conftest import target_probs

ALPHA = 1e-4


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Thousands of tiny per-request ops: intra-op threads only add barrier waits on a shared machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def keys(seeds: list[int], positions: list[int] | None = None) -> RowKeys:
    return RowKeys.of(seeds, positions if positions is not None else [0] * len(seeds))


def draws(seeds: list[int], positions: list[int] | None = None) -> torch.Tensor:
    """Draft uniforms, one per row."""
    return keys(seeds, positions).draw(DRAFT, torch.device("cpu"))


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Independent float64 implementation of temperature -> top-k -> top-p for rows without ties."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for row, values in enumerate(logits.double()):
        probs = (values / params.temperature).softmax(-1)
        order = probs.argsort(descending=True).tolist()
        if params.top_k > 0:
            order = order[: params.top_k]
        kept, mass = [], 0.0
        total = float(probs[order].sum())
        for token in order:
            if mass >= params.top_p * total:
                break
            kept.append(token)
            mass += float(probs[token])
        out[row, kept] = probs[kept] / mass
    return out


def chi2_pvalue(tokens: list[int], probs: torch.Tensor) -> float:
    """Goodness of fit of ``tokens`` to ``probs``. A token with p = 0 must never appear; cells expecting
    fewer than 5 draws are pooled so that the chi-square approximation holds."""
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0, "sampled a token with target probability 0"
    expected = probs.double() / probs.sum() * len(tokens)
    small = (expected < 5) & (probs > 0)
    obs = torch.cat([counts[expected >= 5], counts[small].sum()[None]])
    exp = torch.cat([expected[expected >= 5], expected[small].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) < 2:
        return 1.0
    return float(stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


@dataclass
class Slot:
    """One request pattern, replicated over trials."""

    target_logits: torch.Tensor  # [n+1, V]
    params: SamplingParams
    q: SparseProbs | None = None  # what drafts are drawn from (random slots)
    shipped_q: SparseProbs | None = None  # what the verifier is told, if not q
    drafts: list[int] | None = None  # fixed drafts (greedy slots, or deterministic drafts with q None)

    @property
    def num_drafts(self) -> int:
        return self.target_logits.shape[0] - 1


def run_trials(slots: list[Slot], trials: int, seed: int) -> list[list[list[int]]]:
    """Outputs of one rejection_sample call over trials x slots, grouped per slot."""
    draw = torch.Generator().manual_seed(seed)
    drafts: dict[int, list[list[int]]] = {}
    for s, slot in enumerate(slots):
        if slot.drafts is not None:
            drafts[s] = [slot.drafts] * trials
        elif slot.num_drafts == 0:
            drafts[s] = [[]] * trials
        else:
            picks = torch.multinomial(slot.q.probs, trials, replacement=True, generator=draw)  # [n, trials]
            drafts[s] = slot.q.token_ids.gather(1, picks).T.tolist()
    order = [(t, s) for t in range(trials) for s in range(len(slots))]
    outputs = rejection_sample(
        torch.cat([slots[s].target_logits for _, s in order]),
        [drafts[s][t] for t, s in order],
        [slots[s].q if slots[s].shipped_q is None else slots[s].shipped_q for _, s in order],
        [slots[s].params for _, s in order],
        keys([seed * 1_000_003 + i for i in range(len(order))]),
    )
    grouped: list[list[list[int]]] = [[] for _ in slots]
    for (_, s), tokens in zip(order, outputs):
        assert 1 <= len(tokens) <= slots[s].num_drafts + 1
        assert tokens[:-1] == drafts[s][len(grouped[s])][: len(tokens) - 1]  # accepted drafts come first
        grouped[s].append(tokens)
    return grouped


def position_pvalues(slot: Slot, outputs: list[list[int]]) -> list[float]:
    """One chi-square p-value per output position, against the processed target row."""
    expected = reference_probs(slot.target_logits, slot.params)
    pvalues = []
    for i in range(slot.num_drafts + 1):
        tokens = [out[i] for out in outputs if len(out) > i]
        if len(tokens) >= 200:  # later positions may be reached too rarely to say anything
            pvalues.append(chi2_pvalue(tokens, expected[i]))
    assert pvalues
    return pvalues


def dense(probs: torch.Tensor) -> SparseProbs:
    return SparseProbs(torch.arange(probs.shape[1]).repeat(probs.shape[0], 1), probs.float())


def dirichlet(rows: int, size: int, gen: torch.Generator) -> torch.Tensor:
    x = -torch.rand(rows, size, generator=gen, dtype=torch.float64).log()
    return x / x.sum(-1, keepdim=True)


def dense_slot(seed: int = 0, vocab: int = 8, n: int = 4) -> Slot:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n + 1, vocab, generator=gen) * 1.5
    return Slot(logits, SamplingParams(1.0), q=dense(dirichlet(n, vocab, gen)))


def sparse_slot(seed: int = 1) -> tuple[Slot, SparseProbs]:
    """V = 10, tokens 0-2 impossible under p (logit -inf); q's 4-token support holds tokens 0, 1 (p = 0)
    and 3, 4, and misses 5-9 (p > 0). Also returns the untruncated q the support was cut from."""
    gen = torch.Generator().manual_seed(seed)
    n, vocab = 3, 10
    logits = torch.randn(n + 1, vocab, generator=gen)
    logits[:, :3] = -torch.inf
    full = dirichlet(n, vocab, gen)
    full[:, [0, 1, 3, 4]] += 0.15  # these four are the top of q, yet 5-9 keep about a third of its mass
    full /= full.sum(-1, keepdim=True)
    ids = torch.tensor([[0, 1, 3, 4]] * n)
    kept = full.gather(1, ids)
    truncated = SparseProbs(ids, (kept / kept.sum(-1, keepdim=True)).float())
    return Slot(logits, SamplingParams(1.0), q=truncated), dense(full)


def filtered_slot(seed: int = 2, n: int = 5, vocab: int = 10) -> Slot:
    """Target with temperature, top-k and top-p; q drafted from the raw logits with a top-6 support."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n + 1, vocab, generator=gen) * 1.5
    _, _, q = draft_sample(torch.randn(n, vocab, generator=gen), [SamplingParams(1.3)] * n, draws(list(range(n))), 6)
    return Slot(logits, SamplingParams(0.7, top_p=0.8, top_k=5), q=q)


def test_dense_q_is_lossless() -> None:
    slot = dense_slot()
    pvalues = position_pvalues(slot, run_trials([slot], 6000, seed=10)[0])
    assert len(pvalues) == 5
    assert min(pvalues) > ALPHA, pvalues


def test_sparse_q_with_mismatched_support_is_lossless() -> None:
    slot, _ = sparse_slot()
    outputs = run_trials([slot], 6000, seed=11)[0]
    assert min(position_pvalues(slot, outputs)) > ALPHA
    # Drafts of p = 0 tokens are never accepted, and tokens outside q's support still come out.
    assert all(token >= 3 for out in outputs for token in out)
    assert {out[0] for out in outputs} >= {5, 6, 7, 8, 9}


def test_target_params_are_matched_after_processing() -> None:
    slot = filtered_slot()
    expected = reference_probs(slot.target_logits, slot.params)
    assert ((expected > 0).sum(-1) < 5).any()  # top-p really cuts below top-k somewhere
    assert min(position_pvalues(slot, run_trials([slot], 6000, seed=12)[0])) > ALPHA


def test_mixed_batch_of_random_and_greedy_requests() -> None:
    gen = torch.Generator().manual_seed(3)
    greedy_logits = torch.randn(3, 8, generator=gen)
    argmax = greedy_logits.argmax(-1).tolist()
    greedy = Slot(greedy_logits, SamplingParams(0.0), drafts=[argmax[0], (argmax[1] + 1) % 8])
    plain_greedy = Slot(torch.randn(1, 8, generator=gen), SamplingParams(0.0), drafts=[])
    plain_random = Slot(torch.randn(1, 8, generator=gen), SamplingParams(0.9, top_k=6))
    # Deterministic drafts (q = None): q is one-hot on each draft.
    fixed = Slot(torch.randn(3, 8, generator=gen), SamplingParams(1.0), drafts=[2, 5])
    slots = [dense_slot(4, n=3), greedy, plain_random, filtered_slot(5, vocab=8), plain_greedy, fixed]
    grouped = run_trials(slots, 2500, seed=13)
    assert all(out == [argmax[0], argmax[1]] for out in grouped[1])
    assert all(out == [int(plain_greedy.target_logits.argmax())] for out in grouped[4])
    pvalues = [p for s in (0, 2, 3, 5) for p in position_pvalues(slots[s], grouped[s])]
    assert len(pvalues) >= 8
    assert min(pvalues) > ALPHA, pvalues


def test_detects_a_sampler_that_skips_the_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    slot = dense_slot()
    monkeypatch.setattr(rejection, "correction_distribution", lambda p, q: p)
    assert min(position_pvalues(slot, run_trials([slot], 6000, seed=10)[0])) < 1e-10


def test_detects_a_verifier_given_the_untruncated_q() -> None:
    slot, full = sparse_slot()
    slot.shipped_q = full
    assert min(position_pvalues(slot, run_trials([slot], 6000, seed=11)[0])) < 1e-10


def test_first_acceptance_rate_is_the_overlap_of_p_and_q() -> None:
    slot = dense_slot(6, n=1)
    outputs = run_trials([slot], 6000, seed=14)[0]
    accepted = sum(len(out) == 2 for out in outputs)
    p = reference_probs(slot.target_logits, slot.params)[0]
    overlap = float(torch.minimum(p, slot.q.probs[0].double()).sum())
    assert stats.binomtest(accepted, len(outputs), overlap).pvalue > ALPHA


def test_identical_p_and_q_always_accept() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 12, generator=gen)
    params = SamplingParams(0.8, top_k=9)
    q = dense(target_probs(logits[:3], params))
    outputs = run_trials([Slot(logits, params, q=q)], 2000, seed=15)[0]
    assert all(len(out) == 4 for out in outputs)
    assert chi2_pvalue([out[3] for out in outputs], reference_probs(logits, params)[3]) > ALPHA
    # Drafted by draft_sample from the same logits and params (renormalised in float32): still accepted.
    tokens, _, sparse_q = draft_sample(logits[:3], [params] * 3, draws([1] * 3, [0, 1, 2]), support_size=12)
    out = rejection_sample(logits, [tokens], [sparse_q], [params], keys([1]))
    assert out[0][:3] == tokens


class MarkovModel:
    """Next-token logits depend on the previous token: logits = table[last token]."""

    def __init__(self, vocab: int, seed: int, scale: float) -> None:
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * scale

    def __call__(self, last_tokens: list[int]) -> torch.Tensor:
        return self.table[torch.tensor(last_tokens)]


def speculative_generate(
    target: MarkovModel,
    drafter: MarkovModel,
    params: SamplingParams,
    num_drafts: int,
    length: int,
    trials: int,
    seed: int,
    support: int,
) -> list[list[int]]:
    """Generate ``length`` tokens after token 0 for every trial: draft with draft_sample, verify with
    rejection_sample, repeat. Random keys as the workers use them: the drafter's by position and
    window start, the verifier's by position."""
    seeds = [seed + t for t in range(trials)]
    seqs = [[0] for _ in range(trials)]
    while live := [t for t in range(trials) if len(seqs[t]) <= length]:
        drafts: list[list[int]] = [[] for _ in live]
        qs: list[list[SparseProbs]] = [[] for _ in live]
        starts = [len(seqs[t]) for t in live]
        for step in range(num_drafts):
            last = [(drafts[i] or seqs[t])[-1] for i, t in enumerate(live)]
            draft_keys = RowKeys.of([seeds[t] for t in live], [s + step for s in starts], starts)
            tokens, _, q = draft_sample(drafter(last), [params] * len(live), draft_keys.draw(DRAFT, "cpu"), support)
            for i, token in enumerate(tokens):
                drafts[i].append(token)
                qs[i].append(q[i])
        rows = [target([seqs[t][-1], *drafts[i]]) for i, t in enumerate(live)]
        outputs = rejection_sample(
            torch.cat(rows),
            drafts,
            [SparseProbs.cat(q) if q else None for q in qs],
            [params] * len(live),
            keys([seeds[t] for t in live], starts),
        )
        for t, out in zip(live, outputs):
            seqs[t].extend(out)
    return [seq[1 : length + 1] for seq in seqs]


def test_prefix_dependent_generation_is_lossless() -> None:
    """End to end over several verification rounds with a Markov target: the joint distribution of
    the first two generated tokens matches the target chain's."""
    vocab = 5
    target, drafter = MarkovModel(vocab, 20, 1.0), MarkovModel(vocab, 21, 1.5)
    params = SamplingParams(1.0, top_k=4)
    seqs = speculative_generate(target, drafter, params, 2, 3, trials=4000, seed=16, support=3)
    trans = reference_probs(target.table, params)  # trans[a, b] = P(next = b | last = a)
    pair = (trans[0][:, None] * trans).flatten()  # P(t1 = a, t2 = b)
    assert chi2_pvalue([a * vocab + b for a, b, _ in seqs], pair) > ALPHA
    third = pair.reshape(vocab, vocab).sum(0) @ trans  # marginal of t3
    assert chi2_pvalue([c for _, _, c in seqs], third) > ALPHA


def test_greedy_speculative_decoding_equals_argmax_decoding() -> None:
    vocab, length = 7, 40
    target, drafter = MarkovModel(vocab, 30, 1.0), MarkovModel(vocab, 31, 1.0)
    drafter.table[:4] = target.table[:4]  # agree on some states so drafts are sometimes accepted
    expected = [0]
    for _ in range(length):
        expected.append(int(target.table[expected[-1]].argmax()))
    for num_drafts in (0, 1, 3, 6):
        seq = speculative_generate(
            target, drafter, SamplingParams(0.0), num_drafts, length, trials=1, seed=0, support=4
        )[0]
        assert seq == expected[1:]


def test_an_all_greedy_batch_gives_what_the_general_path_gives() -> None:
    """An all-greedy batch takes a shortcut (one argmax); a random request beside it sends the same greedy
    requests through the general rule. Logits with many ties check the first-argmax rule too."""
    gen = torch.Generator().manual_seed(5)
    vocab, drafts = 6, [[], [1], [2, 3, 4], [0, 0], [5, 1, 2, 3]]
    logits = torch.randint(0, 3, (sum(len(d) + 1 for d in drafts), vocab), generator=gen).float()
    argmax = logits.argmax(-1).tolist()
    drafts[2][:2] = argmax[3:5]  # accepted twice, then a draft that may or may not be the argmax
    drafts[4][0] = argmax[9]
    greedy = [SamplingParams(0.0)] * len(drafts)
    shortcut = rejection_sample(logits, drafts, [None] * len(drafts), greedy, keys([0] * len(drafts)))
    random_row = torch.randn(1, vocab, generator=gen)
    general = rejection_sample(torch.cat([logits, random_row]), drafts + [[]], [None] * (len(drafts) + 1),
                               greedy + [SamplingParams(1.0)], keys([0] * (len(drafts) + 1)))  # fmt: skip
    assert shortcut == general[:-1]
    assert [len(out) for out in shortcut] != [1] * len(drafts)  # some drafts were accepted


def test_results_depend_on_seed_and_position_not_on_the_batch() -> None:
    slot = dense_slot(8, n=4)
    drafts = slot.q.token_ids[:, 0].tolist()
    other = dense_slot(9, n=2)
    alone = rejection_sample(slot.target_logits, [drafts], [slot.q], [slot.params], keys([42], [17]))
    batch = rejection_sample(
        torch.cat([other.target_logits, slot.target_logits, other.target_logits[:1]]),
        [[1, 2], drafts, []],
        [other.q, slot.q, None],
        [other.params, slot.params, SamplingParams(0.0)],
        keys([1, 42, 0], [3, 17, 0]),
    )
    assert batch[1] == alone[0]
    # Other positions (or seeds) draw other numbers: over a few of them the outcome changes.
    outcomes = {
        tuple(rejection_sample(slot.target_logits, [drafts], [slot.q], [slot.params], keys([42], [x]))[0])
        for x in range(30)
    }
    assert len(outcomes) > 1


def test_rejects_inconsistent_shapes() -> None:
    logits = torch.randn(3, 5)
    params = SamplingParams(1.0)
    with pytest.raises(ValueError):
        rejection_sample(logits, [[1]], [None], [params], keys([0]))  # 2 rows expected
    with pytest.raises(ValueError):
        rejection_sample(logits, [[1, 2]], [dense(torch.full((1, 5), 0.2))], [params], keys([0]))
    with pytest.raises(ValueError):
        rejection_sample(logits, [[1, 2]], [None], [params, params], keys([0]))


def test_outputs_with_drafts_are_accepted_prefix_plus_one() -> None:
    # Direct check of the return shape for a small hand-made case: greedy, all drafts accepted.
    logits = torch.eye(4) * 5
    out = rejection_sample(logits, [[0, 1, 2]], [None], [SamplingParams(0.0)], keys([0]))
    assert out == [[0, 1, 2, 3]]


def test_correction_distribution() -> None:
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(rejection.correction_distribution(p, q), torch.tensor([0.3, 0.0, 0.0]))
    # p == q leaves no residual: fall back to p (a rejection there can only come from rounding, or from
    # a draft both give probability 0).
    assert torch.equal(rejection.correction_distribution(p, p.clone()), p)
    # A draft that q says it could not produce (q(d) = 0) is accepted whenever p(d) > 0.
    q_elsewhere = SparseProbs.one_hot(torch.tensor([0]))
    for seed in range(20):
        out = rejection_sample(torch.log(p).repeat(2, 1), [[1]], [q_elsewhere], [SamplingParams(1.0)], keys([seed]))
        assert out[0][0] == 1 and len(out[0]) == 2
