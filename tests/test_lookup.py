"""Drafting without a model: n-gram lookup, suffix matching and Predicted Outputs (engine/lookup.py).

First the proposers on their own, table by table. Then through the engine on the tiny random pair: in every
mode and with each method, greedy output is exactly plain decoding's (strict kernels), while drafts were
proposed and accepted on the way (so the tests can fail); a prediction drafts under every method, and with no
speculative config the verifier drafts from it itself. Sampled outputs follow the target's distribution with
predictions and n-gram drafts (a point mass q), by a chi-square test against the exact joint.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from scipy.stats import chisquare

from minedraft.config import EngineConfig, SpeculativeConfig
from minedraft.engine.engine import LLMEngine
from minedraft.engine.lookup import (
    NgramIndex,
    Prediction,
    SharedSuffixes,
    SuffixIndex,
    SuffixSettings,
    prediction_usage,
)
from minedraft.model.tokenizer import load_tokenizer
from minedraft.sampling.params import SamplingParams

STRICT = {"device": "cpu", "batch_invariant": True}


# --- the proposers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "sizes", "k", "want"),
    [
        ([1, 2, 3, 9, 1, 2], (1, 3), 3, [3, 9, 1]),  # the 2-gram [1, 2] occurred: what followed it
        ([1, 2, 3, 9, 7, 2, 5, 1, 2], (1, 3), 2, [3, 9]),  # longest first: [1, 2], not the later [2]
        ([4, 2, 8, 4, 2, 6, 4, 2], (2, 2), 1, [6]),  # the latest earlier occurrence
        ([5, 6, 7], (1, 3), 4, []),  # nothing repeats: the tail never matches itself
        ([7, 8, 7, 8], (2, 2), 5, [7, 8, 7, 8, 7]),  # a repetition runs on past the context's end
        ([1, 2, 3], (2, 2), 2, []),  # too short for any match
    ],
)
def test_ngram_proposes_what_followed_the_longest_latest_match(tokens, sizes, k, want) -> None:
    index = NgramIndex(*sizes)
    index.extend(tokens)
    assert index.propose(tokens, k) == want


def test_ngram_continues_after_unverified_drafts() -> None:
    """PEARL drafts on after the window being verified: the context is the indexed tokens and that window."""
    index = NgramIndex(2, 2)
    index.extend([1, 2, 3, 4, 9, 1])
    assert index.propose([1, 2, 3, 4, 9, 1, 2], 2) == [3, 4]


def test_suffix_follows_the_most_frequent_continuation_while_likely() -> None:
    settings = SuffixSettings(max_tree_depth=8, max_spec_factor=4.0, min_token_prob=0.3)
    index = SuffixIndex(settings)
    # The longest match is [0, 1, 2] (three times: then 3, 4, 3); after [0, 1, 2, 3]: 5 once, 6 once.
    index.extend(0, [1, 2, 3, 5, 0, 1, 2, 3, 5, 0, 1, 2, 4, 0, 1, 2, 3, 6, 0, 1, 2])
    tokens, score = index.propose([0, 1, 2], 4)
    assert tokens == [3, 5, 0, 1]  # p = 2/3, then 2/3 x 1/2 = 1/3 >= 0.3, then the one way on
    assert score == pytest.approx(2 / 3 + 1 / 3 + 1 / 3 + 1 / 3)


def test_suffix_stops_below_min_token_prob_and_within_depth() -> None:
    index = SuffixIndex(SuffixSettings(max_tree_depth=8, max_spec_factor=4.0, min_token_prob=0.6))
    index.extend(0, [0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2])
    assert index.propose([0, 1, 2], 4) == ([], 0.0)  # 3 or 4, each 1/2 < 0.6
    deep = SuffixIndex(SuffixSettings(max_tree_depth=4, max_spec_factor=8.0, min_token_prob=0.1))
    deep.extend(0, [1, 2, 3, 4, 5, 6, 7, 1, 2])
    assert deep.propose([1, 2], 8)[0] == [3, 4]  # a 2-token match leaves 2 tokens of depth 4


def test_shared_suffixes_stay_within_their_bounds() -> None:
    settings = SuffixSettings()
    by_requests = SharedSuffixes(settings, max_requests=2, max_tokens=1000)
    for output in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        by_requests.add(output)
    assert sorted(len(s) for s in by_requests.index.sequences.values()) == [4, 4]
    assert by_requests.index.propose([0, 1, 2], 2) == ([], 0.0)  # the oldest output was evicted
    assert by_requests.index.propose([0, 9, 10], 2)[0] == [11, 12]
    by_tokens = SharedSuffixes(settings, max_requests=100, max_tokens=10)
    for output in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        by_tokens.add(output)
    assert by_tokens.index.num_tokens <= 10
    assert SharedSuffixes(settings, max_requests=0, max_tokens=10).index.num_tokens == 0


def test_prediction_follows_the_output_and_realigns_after_an_edit() -> None:
    predicted = [10, 11, 12, 13, 14, 15, 16, 17]
    cursor = Prediction(predicted)
    assert cursor.propose(3) == [10, 11, 12]
    cursor.extend([10, 11])
    assert cursor.propose(3) == [12, 13, 14]
    assert cursor.propose(2, drafted=[12, 13]) == [14, 15]  # after a window not yet verified
    assert cursor.propose(2, drafted=[12, 99]) == []  # a window off the prediction: nothing follows it
    cursor.extend([99, 98])  # an edit: lost
    assert cursor.propose(3) == []
    cursor.extend([14, 15])  # the output is back on the prediction: two tokens re-align it
    assert cursor.propose(2) == [16, 17]
    cursor.extend([16, 17])
    assert cursor.usage == (4, 4)  # 10, 11, 16, 17 were the prediction's next token


def test_prediction_usage_counts_as_openai_does() -> None:
    assert prediction_usage([1, 2, 3], [1, 2, 3]) == (3, 0)
    assert prediction_usage([1, 2, 3, 4], [1, 2]) == (2, 2)
    assert prediction_usage([1, 2, 3], [7, 8, 9]) == (0, 3)


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ({"method": "ngram", "model": "some/draft"}, "method ngram drafts without a model: model"),
        ({"method": "suffix", "parallel_drafting": True}, "parallel_drafting does not apply"),
        ({"method": "ngram", "tetris": True}, "tetris does not apply"),
        ({"prompt_lookup_max": 3}, "prompt_lookup_max is a setting of method ngram, not of draft_model"),
        ({"method": "ngram", "suffix_decoding_min_token_prob": 0.5}, "a setting of method suffix, not of ngram"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must be at most prompt_lookup_max"),
    ],
)
def test_speculative_config_refuses_what_a_method_would_ignore(spec, error) -> None:
    with pytest.raises(ValueError, match=error):
        SpeculativeConfig.model_validate(spec)


@pytest.mark.parametrize(("given", "sizes"), [({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)),
                                               ({"prompt_lookup_min": 2}, (2, 2)),
                                               ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4))])
def test_ngram_sizes_default_as_vllm_does(given, sizes) -> None:
    assert SpeculativeConfig(method="ngram", **given).ngram_sizes == sizes


# --- through the engine ----------------------------------------------------------------------------------------

MODES = {
    "sd": {"num_speculative_tokens": 3, "adaptive": False},
    "pearl": {"num_speculative_tokens": 3, "is_parallel": True, "force_pearl": True, "adaptive": False},
    "minedraft": {"num_speculative_tokens": 3, "is_parallel": True, "adaptive": False},
    "minedraft-adaptive": {"num_speculative_tokens": 3, "is_parallel": True},
}
METHODS = {"ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}, "suffix": {"method": "suffix"}}


def _repetitive_workload(vocab: int, n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts that repeat a random phrase (lookups find it), of several lengths, greedy."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        phrase = [rng.randrange(vocab) for _ in range(rng.choice([2, 3, 5]))]
        prompt = phrase * rng.choice([2, 4, 6]) + phrase[: rng.randrange(len(phrase))]
        work.append((prompt, SamplingParams(temperature=0.0, max_tokens=rng.choice([5, 17, 30]), ignore_eos=True)))
    return work


def _generate(config: EngineConfig, work: list[tuple[list[int], SamplingParams]]) -> tuple[list[list[int]], list]:
    """Every output's tokens and the requests (for their stats), all added at once."""
    engine = LLMEngine.local(config)
    try:
        requests = [engine.add_request(prompt, params) for prompt, params in work]
        while engine.has_unfinished():
            engine.step()
        drafter = engine.executor.drafter
        assert drafter is None or drafter.num_active == 0, "finished requests must leave the drafter"
        return [r.output_ids for r in requests], requests
    finally:
        engine.executor.close()


@pytest.fixture(scope="module")
def vocab(pair) -> int:
    return load_tokenizer(pair[0]).vocab_size


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("method", list(METHODS))
def test_lookup_methods_match_autoregressive(pair, vocab, method, mode) -> None:
    target, _ = pair
    work = _repetitive_workload(vocab, n=8, seed=len(mode))
    base = {"model": target, "max_num_seqs": 3, "max_model_len": 128, **STRICT}
    expected, _ = _generate(EngineConfig(**base), work)
    got, requests = _generate(EngineConfig(**base, speculative_config={**MODES[mode], **METHODS[method]}), work)
    assert got == expected
    drafted = sum(r.stats.num_draft_tokens for r in requests)
    accepted = sum(r.stats.num_accepted_tokens for r in requests)
    if mode != "minedraft-adaptive":  # the adaptive controller may rightly keep the tiny pair on plain steps
        assert 0 < accepted <= drafted, (accepted, drafted)


def _edited(tokens: list[int], vocab: int) -> list[int]:
    """The output with a token changed in its middle and one dropped later: a prediction that is right in part."""
    out = list(tokens)
    out[len(out) // 3] = (out[len(out) // 3] + 1) % vocab
    del out[2 * len(out) // 3]
    return out


@pytest.mark.parametrize(
    "spec",
    [None, {"num_speculative_tokens": 4, "adaptive": False}, {"num_speculative_tokens": 4, "is_parallel": True},
     {**METHODS["ngram"], "num_speculative_tokens": 4, "is_parallel": True, "force_pearl": True, "adaptive": False},
     {**METHODS["suffix"], "num_speculative_tokens": 4, "adaptive": False}],
    ids=["ar", "sd+draft-model", "minedraft+draft-model", "pearl+ngram", "sd+suffix"],
)
def test_predictions_draft_in_every_mode_and_match_autoregressive(pair, vocab, spec) -> None:
    """Prompts that repeat nothing, predictions of ar's output edited in two places: drafts come from the
    prediction (with a draft model, it drafts where the prediction has nothing), and the output is ar's. (The
    tiny tokenizer's tokens other than ASCII bytes are biased away: a prediction is text, and theirs does not
    tokenize back to them.)"""
    target, draft = pair
    tokenizer = load_tokenizer(target)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.choice([3, 8]))] for _ in range(6)]
    ascii_ids = [i for i in range(vocab) if tokenizer.decode([i]).isascii()
                 and tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i]]  # fmt: skip
    others = {i: -100.0 for i in range(vocab) if i not in ascii_ids}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logit_bias=others)
    base = {"model": target, "max_num_seqs": 3, "max_model_len": 128, **STRICT}
    expected, _ = _generate(EngineConfig(**base), [(p, params) for p in prompts])
    work = []
    for prompt, output in zip(prompts, expected):
        text = tokenizer.decode(_edited(output, vocab), skip_special_tokens=False)
        work.append((prompt, params.model_copy(update={"prediction": text})))
    if spec is not None and spec.get("method", "draft_model") == "draft_model":
        spec = {**spec, "model": draft}
    got, requests = _generate(EngineConfig(**base, speculative_config=spec), work)
    assert got == expected
    assert sum(r.stats.num_accepted_tokens for r in requests) > sum(len(o) for o in expected) // 3
    for request in requests:
        accepted, rejected = request.prediction_usage
        assert accepted + rejected == len(request.prediction_ids) and accepted > 0


def test_a_prediction_longer_than_the_server_takes_is_refused_by_name(pair) -> None:
    engine = LLMEngine.local(EngineConfig(model=pair[0], max_prediction_tokens=8, **STRICT))
    try:
        with pytest.raises(ValueError, match=r"prediction: 20 tokens is more than this server takes \(8, its "
                                             r"max_prediction_tokens\)"):  # fmt: skip
            engine.add_request([5, 6], SamplingParams(max_tokens=4, prediction="x" * 20))
        assert engine.add_request([5, 6], SamplingParams(max_tokens=4, prediction="x" * 8)) is not None
    finally:
        engine.executor.close()


# --- sampling: the rule is exact for a point mass --------------------------------------------------------------

PROMPT = [5, 17, 42]
PARAMS = dict(temperature=0.8, top_k=6, max_tokens=2, ignore_eos=True)
NUM_SAMPLES = 3000


def _byte_tokens(joint, tokenizer) -> tuple[int, int]:
    """The likeliest pair of tokens that round-trips through text (a prediction is text)."""
    for pair_ids in sorted(joint, key=joint.get, reverse=True):
        text = tokenizer.decode(list(pair_ids), skip_special_tokens=False)
        if tokenizer.encode(text, add_special_tokens=False) == list(pair_ids):
            return pair_ids
    raise AssertionError("no pair of the joint round-trips through text")


@pytest.mark.parametrize("spec", [None, {"num_speculative_tokens": 2, "adaptive": False},
                                  {**METHODS["ngram"], "num_speculative_tokens": 2, "is_parallel": True,
                                   "adaptive": False}], ids=["ar", "sd", "minedraft+ngram"])  # fmt: skip
def test_sampled_outputs_with_a_prediction_follow_the_target_distribution(pair, spec) -> None:
    from test_lossless_sampling import _exact_joint

    target, draft = pair
    tokenizer = load_tokenizer(target)
    joint = _exact_joint(target, PARAMS)
    prediction = tokenizer.decode(list(_byte_tokens(joint, tokenizer)), skip_special_tokens=False)
    if spec is not None and "method" not in spec:
        spec = {**spec, "model": draft}
    config = EngineConfig(model=target, speculative_config=spec, max_num_seqs=64, max_model_len=16, device="cpu")
    engine = LLMEngine.local(config)
    try:
        requests = [engine.add_request(PROMPT, SamplingParams(**PARAMS, seed=i, prediction=prediction))
                    for i in range(NUM_SAMPLES)]  # fmt: skip
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.executor.close()
    drafted = sum(r.stats.num_draft_tokens for r in requests)
    accepted = sum(r.stats.num_accepted_tokens for r in requests)
    assert 0 < accepted < drafted, (accepted, drafted)  # both sides of the rule ran
    counts = Counter(tuple(r.output_ids) for r in requests)
    assert set(counts) <= set(joint)
    big = [c for c in joint if joint[c] * NUM_SAMPLES >= 5]
    rare = [c for c in joint if c not in big]
    observed = [counts[c] for c in big] + [sum(counts[c] for c in rare)] * bool(rare)
    expected = [joint[c] * NUM_SAMPLES for c in big] + [sum(joint[c] for c in rare) * NUM_SAMPLES] * bool(rare)
    scale = sum(observed) / sum(expected)
    result = chisquare(observed, [e * scale for e in expected])
    assert result.pvalue > 1e-3, f"distribution differs from the target's (p={result.pvalue:.2g})"
