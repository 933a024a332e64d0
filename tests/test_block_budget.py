"""Admission, preemption and chunked prefill as the engine decides them: table-driven, no model runs."""

from __future__ import annotations

import pytest

from minedraft.config import BUNDLED_TARGET, EngineConfig
from minedraft.engine.batch_manager import BlockBudget
from minedraft.engine.pipelines import make_pipeline
from minedraft.engine.request import Request, RequestStatus
from minedraft.model.tokenizer import load_tokenizer
from minedraft.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUNDLED_TARGET)


def _request(tokenizer, name: str, prompt_len: int, arrival: float, max_tokens: int = 64) -> Request:
    request = Request.create(name, [5] * prompt_len, SamplingParams(temperature=0, max_tokens=max_tokens), seed=0,
                             max_model_len=256, eos_token_ids=frozenset(), tokenizer=tokenizer)  # fmt: skip
    request.arrival_time = arrival
    return request


def _pipeline(num_blocks: int, **config):
    pipeline = make_pipeline(EngineConfig(**config))
    pipeline.batches.budget = BlockBudget(num_blocks, block_size=16, lookahead=pipeline.lookahead, max_model_len=256)
    return pipeline


def test_a_request_is_charged_its_tokens_drafts_in_flight_and_the_next_step(tokenizer) -> None:
    budget = BlockBudget(num_blocks=100, block_size=16, lookahead=5, max_model_len=256)
    request = _request(tokenizer, "a", 20, 0.0)
    assert budget.blocks(request) == 2  # 20 + 5 tokens
    request.output_ids, request.pending_drafts = [1] * 10, 4
    assert budget.blocks(request) == 3  # 20 + 10 + 4 + 5 = 39
    request.output_ids = [1] * 300
    assert budget.blocks(request) == 16  # never more than max_model_len


def test_admission_waits_for_free_blocks_in_arrival_order(tokenizer) -> None:
    pipeline = _pipeline(num_blocks=6)  # ar: lookahead 1
    for i, length in enumerate((40, 40, 8)):  # 3 + 3 + 1 blocks: the third waits although it is small
        pipeline.batches.add(_request(tokenizer, f"r{i}", length, float(i)))
    admitted, _, verify = pipeline.schedule()
    assert [r.request_id for r in admitted] == ["r0", "r1"] and [t.request_id for t in verify.tasks] == ["r0", "r1"]
    assert [r.request_id for r in pipeline.batches.waiting] == ["r2"]


def test_the_newest_request_is_preempted_when_blocks_run_out_and_resumes_first(tokenizer) -> None:
    pipeline = _pipeline(num_blocks=6)
    old, new = _request(tokenizer, "old", 40, 0.0), _request(tokenizer, "new", 40, 1.0)
    for request in (old, new):
        pipeline.batches.add(request)
    pipeline.schedule()
    new.output_ids = [7] * 8  # 40 + 8 + 1 tokens: 4 blocks, 7 in all
    new.pending_drafts = None
    late = _request(tokenizer, "late", 4, 2.0)
    pipeline.batches.add(late)
    preempted = pipeline.batches.preempt_to_fit()
    assert preempted == [new] and new.status is RequestStatus.WAITING and new.output_ids == [7] * 8
    assert list(pipeline.batches.waiting) == [new, late]
    assert new.token_ids == [5] * 40 + [7] * 8  # what the workers prefill when it is admitted again
    assert pipeline.batches.preempt_to_fit() == []


@pytest.mark.parametrize("spec", [None, {"num_speculative_tokens": 3, "is_parallel": True}])
def test_a_long_prompt_is_prefilled_in_chunks_beside_decoding(tokenizer, spec) -> None:
    pipeline = _pipeline(num_blocks=100, max_num_batched_tokens=64, speculative_config=spec)
    short, long = _request(tokenizer, "short", 4, 0.0), _request(tokenizer, "long", 200, 1.0)
    pipeline.batches.add(short)
    pipeline.batches.add(long)
    chunks = []
    while not chunks or long.num_prefilled is not None:
        _, draft, verify = pipeline.schedule()
        plans = [p for p in (draft, verify) if p is not None]
        assert all(t.request_id == "short" for p in plans for t in p.tasks)  # "long" neither drafts nor verifies
        if spec is not None:
            assert draft is not None and verify is not None and draft.prefill == verify.prefill  # the same chunks
        chunks.append(plans[-1].prefill[0].num_tokens)
        short.pending_drafts = 3 if spec else None  # as after a step: drafted (the verifier holds 3 tokens) or decoded
        assert len(chunks) < 10
    assert chunks[-1] == 199 and chunks == sorted(chunks) and len(chunks) >= 4  # all but the last token, in order
    plans = [p for _ in range(2) for p in pipeline.schedule()[1:] if p is not None]  # MineDraft: both batches
    assert "long" in [t.request_id for p in plans for t in p.tasks] and not any(p.prefill for p in plans)


# --- prefix sharing: blocks that running requests share from the verifier's cache are charged once ---------

SYSTEM = list(range(100, 164))  # four full blocks of 16


def _sharing(num_blocks: int, draft_blocks: int | None = None, **config):
    pipeline = make_pipeline(EngineConfig(**config))
    pipeline.batches.budget = BlockBudget(num_blocks, block_size=16, lookahead=pipeline.lookahead, max_model_len=256,
                                          draft_blocks=draft_blocks, shares_prefixes=True)  # fmt: skip
    return pipeline


def _chat(tokenizer, name: str, arrival: float, **params) -> Request:
    """The shared system prompt and 8 tokens of its own: 72 tokens, 5 blocks with ar's lookahead of 1."""
    request = Request.create(name, SYSTEM + [1 + int(arrival)] * 8,
                             SamplingParams(temperature=0, max_tokens=16, **params), seed=0, max_model_len=256,
                             eos_token_ids=frozenset(), tokenizer=tokenizer)  # fmt: skip
    request.arrival_time = arrival
    return request


def _names(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_a_prefix_is_shared_from_the_step_after_it_was_written(tokenizer) -> None:
    pipeline = _sharing(num_blocks=9)
    first, second = _chat(tokenizer, "first", 0.0), _chat(tokenizer, "second", 1.0)
    pipeline.batches.add(first)
    pipeline.batches.add(second)
    admitted, _, _ = pipeline.schedule()  # nothing is written yet: 5 + 5 blocks do not fit 9
    assert _names(admitted) == ["first"] and first.shared_blocks == 4  # its step writes the system prompt
    admitted, _, _ = pipeline.schedule()
    assert _names(admitted) == ["second"] and second.shared_blocks == 4
    assert pipeline.batches.used_blocks == 6  # 1 + 1 blocks of their own, the 4 shared ones once


def test_a_request_pays_for_shared_blocks_once_no_one_else_holds_them(tokenizer) -> None:
    pipeline = _sharing(num_blocks=100)
    requests = [_chat(tokenizer, f"r{i}", float(i)) for i in range(3)]
    pipeline.batches.add(requests[0])
    pipeline.schedule()
    for request in requests[1:]:
        pipeline.batches.add(request)
    pipeline.schedule()
    assert pipeline.batches.used_blocks == 3 + 4
    requests[0].finish_as("stop")
    pipeline.batches.remove_finished()
    assert pipeline.batches.used_blocks == 2 + 4  # the other two still share the system prompt
    requests[1].finish_as("stop")
    pipeline.batches.remove_finished()
    assert pipeline.batches.used_blocks == 5  # the last holder pays for all its blocks again


def test_preemption_gives_back_what_a_request_shared(tokenizer) -> None:
    pipeline = _sharing(num_blocks=100)
    old, new = _chat(tokenizer, "old", 0.0), _chat(tokenizer, "new", 1.0)
    pipeline.batches.add(old)
    pipeline.schedule()
    pipeline.batches.add(new)
    pipeline.schedule()
    assert pipeline.batches.used_blocks == 1 + 1 + 4
    pipeline.batches.budget = BlockBudget(5, 16, pipeline.lookahead, 256, shares_prefixes=True)
    assert pipeline.batches.preempt_to_fit() == [new] and new.shared_blocks == 0
    assert pipeline.batches.used_blocks == 5


def test_prompt_logprobs_and_the_drafter_pay_in_full(tokenizer) -> None:
    pipeline = _sharing(num_blocks=100)
    first, scored = _chat(tokenizer, "first", 0.0), _chat(tokenizer, "scored", 1.0, prompt_logprobs=0)
    pipeline.batches.add(first)
    pipeline.schedule()
    pipeline.batches.add(scored)
    pipeline.schedule()
    assert scored.shared_blocks == 0 and pipeline.batches.used_blocks == 1 + 4 + 5  # it computes its whole prompt
    spec = {"num_speculative_tokens": 3}
    pipeline = _sharing(num_blocks=100, draft_blocks=11, speculative_config=spec)  # lookahead 4: 5 blocks each
    requests = [_chat(tokenizer, f"r{i}", float(i)) for i in range(3)]
    pipeline.batches.add(requests[0])
    while not requests[0].shared_blocks:
        pipeline.schedule()
        requests[0].pending_drafts = None
    for request in requests[1:]:
        pipeline.batches.add(request)
    admitted, _, _ = pipeline.schedule()
    assert _names(admitted) == ["r1"], "the verifier would hold all three, the drafter's 11 blocks only two"
