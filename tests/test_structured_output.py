"""Structured output (JSON schema, regex, choice, any JSON object): the output follows the grammar, in every
decoding mode exactly as the target alone (ar) would give it.

Greedy output under each grammar equals ar's token for token in sd, pearl, minedraft, +tetris and PARD
(strict kernels, as tests/test_greedy_equivalence.py runs them). Sampled at temperature 1 under MineDraft,
every output parses and validates against its schema. An output cut by max_tokens finishes with "length".
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
from pydantic import ValidationError
from test_greedy_equivalence import MODES  # sd, pearl, minedraft, minedraft+tetris

from minedraft.engine.engine import LLMEngine
from minedraft.model.kv_cache import bytes_per_block
from minedraft.model.runner import ModelRunner
from minedraft.model.tokenizer import load_tokenizer
from minedraft.sampling.params import SamplingParams, StructuredOutputs

from conftest import pard_draft, tiny_config

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "bc"]},
    },
    "required": ["name", "ok", "n", "kind"],
}
REGEX = "[a-z]{2,5}-[0-9]{1,3}"
CHOICE = ["yes", "no", "maybe"]
GRAMMARS = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICE}, {"json_object": True}]
PROMPTS = [[5, 17, 42, 9], [100, 3], [7]]


def _requests(config, work: list[tuple[list[int], SamplingParams]], in_flight: int = 1) -> list:
    engine = LLMEngine.local(config, max_in_flight=in_flight)
    try:
        requests = [engine.add_request(prompt, params) for prompt, params in work]
        while engine.has_unfinished() or engine.in_flight:
            engine.advance()
        return requests
    finally:
        engine.executor.close()


def _assert_follows(text: str, grammar: dict) -> None:
    kind, source = next(iter(grammar.items()))
    if kind == "json":
        jsonschema.validate(json.loads(text), source)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(source, text), text
    else:
        assert text in source, text


@pytest.fixture(scope="module")
def greedy(pair) -> tuple[list[tuple[list[int], SamplingParams]], list[list[int]]]:
    """Every grammar on every prompt, greedy, in one batch (with an unconstrained request beside them), and
    ar's outputs."""
    cases = [(p, g) for p in PROMPTS for g in [*GRAMMARS, None]]
    work = [(p, SamplingParams(temperature=0.0, max_tokens=96 if g else 12, structured_outputs=g)) for p, g in cases]
    requests = _requests(tiny_config(pair, max_num_seqs=4), work)
    tokenizer = load_tokenizer(pair[0])
    for (_, grammar), request in zip(cases, requests):
        # Any JSON object has keys of any length: the tiny model may spin in one until max_tokens.
        if grammar is not None and (request.finish_reason == "stop" or "json_object" not in grammar):
            assert request.finish_reason == "stop", tokenizer.decode(request.output_ids)
            _assert_follows(tokenizer.decode(request.output_ids), grammar)
    return work, [r.output_ids for r in requests]


@pytest.mark.parametrize("in_flight", [1, 2], ids=["one-in-flight", "planned-ahead"])
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_under_a_grammar_equals_ar(pair, greedy, mode: str, in_flight: int) -> None:
    work, expected = greedy
    got = [r.output_ids for r in _requests(tiny_config(pair, MODES[mode], max_num_seqs=4), work, in_flight)]
    for (_, params), exp, out in zip(work, expected, got):
        assert out == exp, f"{mode}: {params.structured_outputs}"


def test_greedy_under_a_grammar_with_parallel_drafting_equals_ar(pair, greedy, tmp_path) -> None:
    work, expected = greedy
    spec = {"num_speculative_tokens": 3, "is_parallel": True, "parallel_drafting": True}
    config = tiny_config((pair[0], pard_draft(pair[1], tmp_path)), spec, max_num_seqs=4)
    assert [r.output_ids for r in _requests(config, work)] == expected


def test_tensor_parallel_verifier_ranks_give_the_same_output(pair, greedy) -> None:
    """Rank 0 samples with the masks; the other ranks hold the grammar states and never need them."""
    from minedraft import LLM

    work, expected = greedy
    with LLM(pair[0], {**MODES["minedraft"], "model": pair[1]}, tensor_parallel_size=2, max_num_seqs=4,
             max_model_len=128, device="cpu", batch_invariant=True) as llm:  # fmt: skip
        outputs = llm.generate([p for p, _ in work], [params for _, params in work], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_preempted_requests_keep_their_grammar_state(pair, greedy) -> None:
    """A KV pool too small for the batch: requests are preempted and re-admitted with their output so far,
    which their matchers must accept again as output (not skip as prompt)."""
    work, expected = greedy
    blocks = 24
    config = tiny_config(pair, MODES["minedraft"], max_num_seqs=4, block_size=8, max_model_len=104,
                         kv_cache_memory_bytes=_kv_bytes(pair[0], blocks, block_size=8))  # fmt: skip
    engine = LLMEngine.local(config, max_in_flight=2)
    try:
        requests = [engine.add_request(prompt, params) for prompt, params in work]
        while engine.has_unfinished() or engine.in_flight:
            engine.advance()
        assert engine.num_preemptions > 0, "the budget is meant to force preemption"
    finally:
        engine.executor.close()
    assert [r.output_ids for r in requests] == expected


def _kv_bytes(target: str, blocks: int, block_size: int) -> int:
    config = ModelRunner(target, max_seq_len=8).config
    return blocks * bytes_per_block(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                                    block_size, torch.float32)  # fmt: skip


def test_sampled_json_always_validates_under_minedraft(pair) -> None:
    """50 prompts at temperature 1: the grammar leaves the model no way to break the schema."""
    params = [SamplingParams(temperature=1.0, max_tokens=100, seed=i, structured_outputs={"json": SCHEMA})
              for i in range(50)]  # fmt: skip
    work = [([3 + i, 40 + i % 7], p) for i, p in enumerate(params)]
    requests = _requests(tiny_config(pair, MODES["minedraft"], max_num_seqs=8), work)
    tokenizer = load_tokenizer(pair[0])
    texts = [tokenizer.decode(r.output_ids) for r in requests]
    for request, text in zip(requests, texts):
        assert request.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 10, "sampling at temperature 1 should give many different objects"


def test_output_cut_by_max_tokens_finishes_with_length(pair) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"json": SCHEMA})
    (request,) = _requests(tiny_config(pair, MODES["sd"]), [(PROMPTS[0], params)])
    assert request.finish_reason == "length" and len(request.output_ids) == 4
    assert load_tokenizer(pair[0]).decode(request.output_ids) == '{"na'


def test_rows_are_masked_with_the_state_after_their_drafts(pair) -> None:
    """The masking itself: each row allows what the grammar allows after the tokens before it; a row without
    a grammar is untouched; a row the mask would leave empty is left as it was."""
    from minedraft.sampling.grammar import GrammarBook, masked

    tokenizer = load_tokenizer(pair[0])
    a, b, c = (tokenizer.token_to_id(ch) for ch in "abc")
    vocab = tokenizer.vocab_size
    book = GrammarBook(tokenizer, vocab, [2])
    state = book.state(StructuredOutputs(choice=["ab", "c"]), num_prompt=1)
    state.sync([9])  # the prompt alone: nothing to match yet
    logits = torch.randn(4, vocab)
    logits[3, [a, c]] = float("-inf")  # as bad words might leave it
    out = masked(logits, [(state, []), (None, ()), (state, [a]), (state, [])], vocab)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == sorted([a, c])
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [b]
    narrow = masked(torch.randn(1, c), [(state, [])], vocab)  # a drafter's smaller vocabulary: only "a" fits
    assert torch.isfinite(narrow[0]).nonzero().flatten().tolist() == [a]
    state.sync([9, a, b])  # committed "ab": only EOS may follow
    assert torch.isfinite(masked(torch.randn(1, vocab), [(state, [])], vocab)[0]).nonzero().flatten().tolist() == [2]


@pytest.mark.parametrize("mode", ["ar", "minedraft"])
def test_a_resumed_request_continues_its_grammar_exactly(pair, greedy, mode: str) -> None:
    """What the gateway sends when it moves a request to another group: the prompt plus the output so far,
    with resumed_tokens saying how much of it is output. The grammar's matcher replays that output, so the
    continuation is the rest of the original output."""
    work, expected = greedy
    cases = [(w, out) for w, out in zip(work, expected) if w[1].structured_outputs is not None and len(out) > 3]
    cut = 3
    resumed = [(prompt + out[:cut], params.model_copy(update={"resumed_tokens": cut,
                                                              "max_tokens": params.max_tokens - cut}))
               for (prompt, params), out in cases]  # fmt: skip
    got = [r.output_ids for r in _requests(tiny_config(pair, MODES.get(mode), max_num_seqs=4), resumed, 2)]
    assert cases and got == [out[cut:] for _, out in cases]


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ({"regex": "[a-z"}, "structured_outputs.regex"),
        ({"json": '{"type": "object", "properties": 3}'}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
    ],
)
def test_malformed_grammars_are_refused_by_the_engine(pair, grammar, message) -> None:
    engine = LLMEngine.local(tiny_config(pair))
    try:
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.add_request([5, 6], SamplingParams(structured_outputs=grammar))
    finally:
        engine.executor.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        {"structured_outputs": {}},
        {"structured_outputs": {"choice": []}},
        {"structured_outputs": {"grammar": "root ::= 'a'"}},
        {"structured_outputs": {"json_object": True}, "ignore_eos": True},
        {"structured_outputs": {"json_object": True}, "min_tokens": 2},
    ],
)
def test_bad_structured_outputs_are_refused_by_sampling_params(kwargs) -> None:
    with pytest.raises(ValidationError, match="structured_outputs"):
        SamplingParams(**kwargs)


def test_without_xgrammar_a_grammar_is_a_clear_error_and_plain_requests_never_import_it(pair) -> None:
    """The grammar library is an optional extra: nothing on the default path imports it."""
    script = f"""
import sys
sys.modules["xgrammar"] = None  # as if it were not installed
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import tiny_config
from minedraft.engine.engine import LLMEngine
from minedraft.model.kv_cache import bytes_per_block
from minedraft.model.runner import ModelRunner
from minedraft.sampling.params import SamplingParams, StructuredOutputs
engine = LLMEngine.local(tiny_config({tuple(pair)!r}, {MODES["minedraft"]!r}))
engine.add_request([5, 6], SamplingParams(temperature=0, max_tokens=4))
while engine.has_unfinished():
    engine.advance()
try:
    engine.add_request([5, 6], SamplingParams(structured_outputs={{"choice": ["a"]}}))
except ValueError as exc:
    print(exc)
engine.executor.close()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "needs xgrammar: pip install 'minedraft[structured]'" in done.stdout
