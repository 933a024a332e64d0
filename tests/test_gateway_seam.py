"""Text across a migration seam: the gateway's stream is the same, wherever the seam falls.

A group's reply is cut at every token position and the rest comes from "another group" (the messages a
resubmission returns); the streamed text must equal the one-piece text byte for byte, with multi-byte
characters split over tokens and a stop string that spans the seam.
"""

from __future__ import annotations

import pytest

from minedraft.api import generate_pb2
from minedraft.config import BUNDLED_TARGET
from minedraft.engine.request import Request
from minedraft.gateway.router import Migration
from minedraft.model.tokenizer import load_tokenizer
from minedraft.sampling.params import SamplingParams

TEXT = "naïve café → 日本語のテキスト 🙂🙃 and then STOP here, nothing after"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUNDLED_TARGET)


def _one_piece(tokenizer, prompt: list[int], ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
    request = Request.create("r", prompt, params, seed=0, max_model_len=10_000, eos_token_ids=frozenset(),
                             tokenizer=tokenizer)  # fmt: skip
    request.append_tokens(ids)
    request.finish_as("length")
    return request.output_ids, request.text


def _migrated(tokenizer, prompt: list[int], ids: list[int], params: SamplingParams, seam: int):
    migration = Migration("r", prompt, params, tokenizer)
    first = [generate_pb2.GenerateResponse(token_ids=[t]) for t in ids[:seam]]  # token by token, then the group dies
    streamed = [migration.take(reply) for reply in first]
    resubmitted = migration.submission()
    assert list(resubmitted.prompt_token_ids.ids) == prompt + migration.mirror.output_ids
    assert resubmitted.sampling.max_tokens == params.max_tokens - len(migration.mirror.output_ids)
    assert resubmitted.sampling.seed == migration.params.seed  # the same seed for every submission
    if not migration.mirror.finished:
        rest = generate_pb2.GenerateResponse(token_ids=ids[seam:], finish_reason=generate_pb2.FINISH_REASON_LENGTH)
        streamed.append(migration.take(rest))
    messages = [m for m in streamed if m is not None]
    return [t for m in messages for t in m.token_ids], "".join(m.text for m in messages), messages[-1]


@pytest.mark.parametrize("stop", [None, ["STOP"], ["🙂🙃"]])
def test_text_is_exact_wherever_the_seam_falls(tokenizer, stop) -> None:
    prompt = tokenizer.encode("Say it: ")
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT.encode()) // 3  # multi-byte characters span several tokens
    params = SamplingParams(temperature=0, max_tokens=len(ids), stop=stop)
    expected_ids, expected_text = _one_piece(tokenizer, prompt, ids, params)
    if stop:
        assert stop[0] not in expected_text and len(expected_ids) < len(ids)
    for seam in range(1, len(ids)):
        got_ids, got_text, last = _migrated(tokenizer, prompt, ids, params, seam)
        assert (got_ids, got_text) == (expected_ids, expected_text), f"seam after token {seam}"
        assert last.usage.completion_tokens == len(expected_ids) and last.usage.prompt_tokens == len(prompt)
        expected_reason = generate_pb2.FINISH_REASON_STOP if stop else generate_pb2.FINISH_REASON_LENGTH
        assert last.finish_reason == expected_reason


def test_a_request_without_seed_gets_one_pinned(tokenizer) -> None:
    seeds = {Migration("r", [1, 2], SamplingParams(temperature=1.0), tokenizer).params.seed for _ in range(8)}
    assert None not in seeds and len(seeds) == 8
    assert Migration("r", [1, 2], SamplingParams(seed=7), tokenizer).params.seed == 7
