"""Penalties, biases, min_p, min_tokens and logprobs: what they do, and that every decoding mode keeps them
exactly.

The processing is checked against a plain per-token reference written here from vLLM's documented
semantics. Through the engine: greedy output with each option equals the target alone (ar) with the same
option, token for token, in sd, pearl, minedraft and +tetris, with requests of different options in one
batch (strict kernels, as the greedy-equivalence tests run); so are the logprobs returned. The
statistical check of the sampled distribution under a penalty and a bias is in
tests/test_lossless_sampling.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from test_greedy_equivalence import MODES  # sd, pearl, minedraft, minedraft+tetris

from minedraft.config import EngineConfig
from minedraft.engine.engine import LLMEngine
from minedraft.model.kv_cache import bytes_per_block
from minedraft.model.runner import ModelRunner, SeqInput
from minedraft.model.tokenizer import load_tokenizer
from minedraft.sampling.params import SamplingParams
from minedraft.sampling.penalties import History, apply_penalties
from minedraft.sampling.sampler import processed_probs

from conftest import tiny_config

EOS = 2
G_ID = 41  # "G" in the tiny checkpoints' byte-level vocabulary


def _reference(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """One row, token by token, as vLLM documents the options (min_tokens, bias, then the penalties)."""
    out = []
    for token, value in enumerate(logits):
        if len(output) < params.min_tokens and token in {*params.stop_token_ids, *([] if params.ignore_eos else [EOS])}:
            value = float("-inf")
        value += params.logit_bias.get(token, 0.0)
        if token in prompt or token in output:
            value = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        value -= params.frequency_penalty * output.count(token) + params.presence_penalty * (token in output)
        out.append(value)
    return out


def test_penalties_match_the_per_token_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    tokens = [3, 4, 5, 5, 6, 5, 7]  # prompt 3 4 5, output 5 6 5 7
    cases = [
        (SamplingParams(presence_penalty=0.7), [8]),
        (SamplingParams(frequency_penalty=-0.4, presence_penalty=1.1), [5, 5]),
        (SamplingParams(repetition_penalty=1.6), [9]),
        (SamplingParams(logit_bias={1: 3.5, 5: -100.0}), []),
        (SamplingParams(min_tokens=6, stop_token_ids=[9]), []),  # 4 outputs: EOS and 9 banned
        (SamplingParams(min_tokens=6, stop_token_ids=[9]), [9, 1]),  # 6 outputs: allowed again
        (SamplingParams(min_tokens=5, ignore_eos=True), []),
        (SamplingParams(), [1]),  # untouched
    ]
    logits = torch.randn(len(cases), vocab, generator=gen) * 3
    params = [p for p, _ in cases]
    histories = [History(tokens, 3, extra) for _, extra in cases]
    got = apply_penalties(logits.clone(), params, histories, [EOS])
    for row, (p, extra) in enumerate(cases):
        expected = _reference(logits[row].tolist(), p, tokens[:3], tokens[3:] + extra)
        assert torch.allclose(got[row], torch.tensor(expected), atol=1e-5), (row, p)
    assert got[4, EOS] == got[4, 9] == float("-inf") and torch.isfinite(got[5]).all()
    assert torch.isfinite(got[6, EOS]) and got[6, 9] == logits[6, 9]
    assert torch.equal(got[7], logits[7])


def test_bad_words_ban_their_last_token_where_the_output_ends_with_the_rest() -> None:
    tokens, words = [3, 4, 5, 5, 6, 5, 7], [[7], [6, 5, 9], [5, 8], [4, 10]]  # output 5 6 5 7
    params = SamplingParams(bad_words=["x"])  # the engine tokenizes the words; the rows carry the ids
    rows = [History(tokens, 3, extra, words) for extra in ([], [6, 5], [6])]
    got = apply_penalties(torch.zeros(3, 12), [params] * 3, rows, [EOS])
    banned = [set(torch.nonzero(row == float("-inf")).flatten().tolist()) for row in got]
    # [4, 10]: 4 is prompt, never output. Drafts before a row count as output.
    assert banned == [{7}, {7, 9, 8}, {7}]


def test_min_p_keeps_tokens_within_the_ratio_of_the_best() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    probs = processed_probs(logits, [SamplingParams(min_p=0.2)])  # keeps p >= 0.1
    assert torch.allclose(probs, torch.tensor([[0.5, 0.3, 0.12, 0]]) / 0.92)
    assert torch.allclose(processed_probs(logits, [SamplingParams(min_p=0.2, top_k=2)]),
                          torch.tensor([[0.625, 0.375, 0, 0]]))  # fmt: skip


@pytest.mark.parametrize(
    "kwargs",
    [{"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0}, {"min_p": 1.5},
     {"logit_bias": {5: 101.0}}, {"logit_bias": {-1: 1.0}}, {"min_tokens": -1}, {"min_tokens": 17}],
)  # fmt: skip
def test_out_of_range_options_are_refused_by_name(kwargs) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)) in str(info.value)


def _options(first_tokens: list[int]) -> list[SamplingParams]:
    """Each option once, greedy, with settings strong enough to change the tiny target's output."""
    greedy = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    return [
        SamplingParams(**greedy),
        SamplingParams(**greedy, presence_penalty=2.0),
        SamplingParams(**greedy, frequency_penalty=1.5),
        SamplingParams(**greedy, repetition_penalty=1.9),
        SamplingParams(**greedy, logit_bias={first_tokens[0]: -100.0, 11: 4.0}),
        SamplingParams(**{**greedy, "ignore_eos": False}, min_tokens=8, stop_token_ids=[first_tokens[1]]),
        SamplingParams(**greedy, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.1),
        # A bias makes "G" (token G_ID) the greedy choice everywhere; the bad word "GG" then bans it after itself.
        SamplingParams(**greedy, logit_bias={G_ID: 20.0}, bad_words=["GG"]),
    ]


def _run(config: EngineConfig, work: list[tuple[list[int], SamplingParams]], in_flight: int = 1) -> list[list[int]]:
    return [r.output_ids for r in _requests(config, work, in_flight)]


def _requests(config: EngineConfig, work: list[tuple[list[int], SamplingParams]], in_flight: int = 1,
              stats: dict | None = None) -> list:  # fmt: skip
    engine = LLMEngine.local(config, max_in_flight=in_flight)
    try:
        requests = [engine.add_request(prompt, params) for prompt, params in work]
        while engine.has_unfinished() or engine.in_flight:
            engine.advance()
        if stats is not None:
            stats["preemptions"] = engine.num_preemptions
        return requests
    finally:
        engine.executor.close()


@pytest.fixture(scope="module")
def workload(pair) -> tuple[list[tuple[list[int], SamplingParams]], list[list[int]]]:
    """Every option on two prompts, all in one batch, and ar's outputs for it."""
    prompts = [[5, 17, 42, 9], [100, 3]]
    plain = _run(tiny_config(pair), [(p, SamplingParams(temperature=0.0, max_tokens=2)) for p in prompts])
    assert load_tokenizer(pair[0]).encode("GG", add_special_tokens=False) == [G_ID, G_ID]
    work = [(p, params) for p, first in zip(prompts, plain) for params in _options(first)]
    expected = _run(tiny_config(pair, max_num_seqs=4), work)
    return work, expected


def test_each_option_changes_the_greedy_output(workload) -> None:
    """Otherwise the equivalence below would prove nothing."""
    _, expected = workload
    per_prompt = len(expected) // 2
    for start in (0, per_prompt):
        plain, *optioned = expected[start : start + per_prompt]
        assert all(out != plain for out in optioned), optioned
    min_tokens_rows = [expected[5], expected[5 + per_prompt]]
    assert all(len(out) >= 8 for out in min_tokens_rows)
    for out in (expected[per_prompt - 1], expected[-1]):  # bad words: G every other token, never twice in a row
        assert out.count(G_ID) >= 10 and all(not (a == b == G_ID) for a, b in zip(out, out[1:])), out


@pytest.mark.parametrize("in_flight", [1, 2], ids=["one-in-flight", "planned-ahead"])
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_with_each_option_equals_ar(pair, workload, mode: str, in_flight: int) -> None:
    work, expected = workload
    got = _run(tiny_config(pair, MODES[mode], max_num_seqs=4), work, in_flight)
    for (_, params), exp, out in zip(work, expected, got):
        assert out == exp, f"{mode}: {params.model_dump(exclude_defaults=True)}"


@pytest.mark.parametrize("mode", ["sd", "pearl", "minedraft+tetris"])
def test_logprobs_under_speculation_equal_ar(pair, workload, mode: str) -> None:
    """The target's logprobs of each token, and its top 3, whatever the mode (the drafter's never show)."""
    work = [(prompt, params.model_copy(update={"logprobs": 3 if i % 2 else 0})) for i, (prompt, params)
            in enumerate(workload[0])]  # fmt: skip
    expected = _requests(tiny_config(pair, max_num_seqs=4), work)
    got = _requests(tiny_config(pair, MODES[mode], max_num_seqs=4), work, in_flight=2)
    for exp, out in zip(expected, got):
        assert out.output_ids == exp.output_ids
        assert len(out.logprobs) == len(out.output_ids) and out.logprobs == exp.logprobs
        for lp in out.logprobs:
            assert len(lp.top_ids) == exp.params.logprobs and lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
            if lp.top_ids:  # greedy: the token is the best one (of the penalised logits)
                assert lp.logprob == lp.top_logprobs[0] < 0
    assert any(r.logprobs[0].logprob < -0.5 for r in expected)  # not all one-hot: the target's own distribution


def test_logprobs_of_a_sampled_token_follow_its_processed_distribution(pair) -> None:
    """Random requests: each token's logprob is log p of the distribution it was drawn from (top_k keeps 4)."""
    params = SamplingParams(temperature=0.7, top_k=4, max_tokens=6, seed=3, logprobs=5, presence_penalty=1.0)
    (request,) = _requests(tiny_config(pair, MODES["sd"]), [([5, 17, 42, 9], params)])
    for token, lp in zip(request.output_ids, request.logprobs):
        assert lp.logprob == lp.top_logprobs[lp.top_ids.index(token)]
        assert abs(sum(math.exp(v) for v in lp.top_logprobs[:4]) - 1) < 1e-4 and lp.top_logprobs[4] == -math.inf


def test_preempted_requests_keep_their_options(pair, workload) -> None:
    """A KV pool with room for about two requests: requests are preempted and re-admitted with their output
    so far, which the options must still count as output (not as prompt)."""
    work, expected = workload
    config = tiny_config(pair, MODES["minedraft"], max_num_seqs=4, block_size=8, max_model_len=40,
                         kv_cache_memory_bytes=_kv_bytes(pair[0], blocks=8, block_size=8))  # fmt: skip
    stats: dict = {}
    got = [r.output_ids for r in _requests(config, work, in_flight=2, stats=stats)]
    assert stats["preemptions"] > 0, "the budget is meant to force preemption"
    assert got == expected


def _kv_bytes(target: str, blocks: int, block_size: int) -> int:
    config = ModelRunner(target, max_seq_len=8).config
    return blocks * bytes_per_block(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                                    block_size, torch.float32)  # fmt: skip


@pytest.mark.parametrize("mode", ["ar", "minedraft"])
def test_a_resumed_request_continues_exactly(pair, workload, mode: str) -> None:
    """What the gateway sends when it moves a request to another group: the prompt plus the output so far,
    with resumed_tokens saying how much of it is output. Every option (min_tokens, penalties, bad words)
    counts those tokens as output, so the continuation is the rest of the original output."""
    work, expected = workload
    cut = 7
    resumed = [(prompt + out[:cut], params.model_copy(update={"resumed_tokens": cut,
                                                              "max_tokens": params.max_tokens - cut}))
               for (prompt, params), out in zip(work, expected)]  # fmt: skip
    got = _run(tiny_config(pair, MODES.get(mode), max_num_seqs=4), resumed, in_flight=2)
    for (_, params), exp, out in zip(work, expected, got):
        assert out == exp[cut:], params.model_dump(exclude_defaults=True)
    engine = LLMEngine.local(tiny_config(pair))
    with pytest.raises(ValueError, match="resumed_tokens: must be less than the prompt's 3 tokens"):
        engine.add_request([1, 2, 3], SamplingParams(resumed_tokens=3))
    engine.executor.close()


def _direct_prompt_logprobs(target: str, prompt: list[int], num_top: int) -> list[tuple[float, list[int], int]]:
    """The reference: the target alone over the whole prompt, log_softmax of its raw logits at each position."""
    runner = ModelRunner(target, num_slots=1, max_seq_len=len(prompt) + 1, batch_invariant=True)
    logits = runner.forward([SeqInput(runner.allocate_slot(), prompt, 0, num_logits=len(prompt))])
    logprobs = logits.float().log_softmax(dim=-1)[:-1]
    chosen = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    return list(zip(chosen.squeeze(1).tolist(), logprobs.topk(num_top, dim=-1).indices.tolist(), ranks))


def _assert_prompt_logprobs(pair, request, num_top: int) -> None:
    expected = _direct_prompt_logprobs(pair[0], request.prompt_ids, num_top)
    assert len(request.prompt_logprobs) == len(request.prompt_ids) - 1
    for lp, (value, top_ids, rank) in zip(request.prompt_logprobs, expected):
        assert lp.logprob == pytest.approx(value, abs=1e-4) and lp.top_ids[:1] == top_ids[:1] and lp.rank == rank
        assert len(lp.top_ids) == num_top and lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


PROMPT_LP_PROMPTS = [[5, 17, 42, 9, 77, 13, 21, 8, 90, 4, 33], [100, 3], [7]]


@pytest.mark.parametrize("mode", ["ar", "sd", "minedraft"])
def test_prompt_logprobs_equal_the_target_over_the_whole_prompt(pair, mode: str) -> None:
    """Every mode returns the target's raw log_softmax at each prompt position, with a penalty and a temperature
    on the output (neither applies to the prompt); the drafter's never show."""
    params = [SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=3, repetition_penalty=1.5),
              SamplingParams(temperature=0.8, seed=1, max_tokens=6, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=0),
              SamplingParams(max_tokens=4)]  # fmt: skip
    work = list(zip(PROMPT_LP_PROMPTS + [PROMPT_LP_PROMPTS[0]], params))
    requests = _requests(tiny_config(pair, MODES.get(mode), max_num_seqs=4), work, in_flight=2)
    for request, p in zip(requests[:3], params):
        _assert_prompt_logprobs(pair, request, p.prompt_logprobs)
    assert requests[2].prompt_logprobs == [] and requests[3].prompt_logprobs is None
    assert requests[0].output_ids == _run(tiny_config(pair), [work[0]])[0]  # the extra rows change no output
    assert any(lp.rank > 1 for lp in requests[0].prompt_logprobs)  # the target's view, not the prompt echoed


@pytest.mark.parametrize("mode", ["ar", "minedraft"])
def test_prompt_logprobs_of_a_chunked_prompt_and_a_cached_prefix(pair, mode: str) -> None:
    """A prompt longer than max_num_batched_tokens is written over several steps, and a request whose prefix
    the cache holds (a first request left it there) still gets every prompt position's logprob."""
    prefix = [(i * 7 + 3) % 200 + 4 for i in range(90)]
    first = (prefix + [11, 12], SamplingParams(temperature=0.0, max_tokens=3))
    later = [(prefix + [13, 14, 15], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1)),
             (prefix + [16], SamplingParams(temperature=0.0, max_tokens=3))]
    config = tiny_config(pair, MODES.get(mode), max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
                         enable_prefix_caching=True)  # fmt: skip
    engine = LLMEngine.local(config)
    try:
        warm = engine.add_request(*first)
        while engine.has_unfinished():
            engine.advance()
        requests = [engine.add_request(*w) for w in later]
        while engine.has_unfinished() or engine.in_flight:
            engine.advance()
    finally:
        engine.executor.close()
    assert warm.finished and requests[0].output_ids == _run(tiny_config(pair), [later[0]])[0]
    _assert_prompt_logprobs(pair, requests[0], 1)


def test_prompt_logprobs_under_tensor_parallelism(pair) -> None:
    """Every verifier rank produces the same prompt rows (a chunked prompt among them); rank 0's values come
    back, equal to the target alone on the whole prompt."""
    from minedraft import LLM

    prompts = [PROMPT_LP_PROMPTS[0], [(i * 5 + 1) % 200 + 4 for i in range(80)]]
    params = [SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2), SamplingParams(max_tokens=4)]
    with LLM(pair[0], {**MODES["minedraft"], "model": pair[1]}, tensor_parallel_size=2, max_num_seqs=4,
             max_model_len=128, max_num_batched_tokens=64, device="cpu", batch_invariant=True) as llm:  # fmt: skip
        outputs = llm.generate(prompts * 2, params + params[::-1], use_tqdm=False)
    asked = [outputs[0], outputs[3]]
    assert outputs[1].prompt_logprobs is None and outputs[2].prompt_logprobs is None
    for out in asked:
        expected = _direct_prompt_logprobs(pair[0], out.prompt_token_ids, 2)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
        for token, got, (value, top_ids, _) in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], expected):
            assert got[token] == pytest.approx(value, abs=1e-4) and top_ids[0] in got
