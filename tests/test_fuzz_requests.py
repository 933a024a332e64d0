"""Property-based fuzzing of every public edge: no input may cause a server error or harm the next request.

Hypothesis draws requests with extreme and ill-typed values (ints past every integer width, NaN and
infinities, bools and strings where numbers go, lone surrogates, nested garbage) mixed with plausible
ones, and sends them through the OpenAI HTTP API, the gRPC API, the gateway and the offline `LLM` API of a
real stack. Each answer must be a success or a client error (HTTP 4xx, INVALID_ARGUMENT), and a canary
sent right after must succeed within seconds. `MINEDRAFT_FUZZ_EXAMPLES` sets how many requests each
test draws (CI's default keeps the suite short; raise it for a longer run).
"""

from __future__ import annotations

import json
import os
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from minedraft import LLM
from minedraft.api import generate_pb2 as pb
from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.sampling.params import SamplingParams
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

import services

MODEL = "minedraft-target"
MAX_MODEL_LEN = 128
CANARY = "def main():"
EXAMPLES = int(os.environ.get("MINEDRAFT_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip

_WIDTHS = [-(2**64), -(2**63) - 1, -(2**63), -(2**31) - 1, -(2**31), -1, 0, 1, 2**31 - 1, 2**31, 2**32 - 1,
           2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]  # fmt: skip
extreme_ints = st.sampled_from(_WIDTHS) | st.integers()
texts = st.text(max_size=6) | st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2)  # lone surrogates
anything = st.one_of(
    extreme_ints,
    st.floats(),  # NaN and the infinities included
    st.booleans(),
    st.none(),
    texts,
    st.lists(extreme_ints | st.booleans() | texts | st.floats(), max_size=3),
    st.dictionaries(texts, extreme_ints | texts, max_size=2),
)
# Values past an integer width, alone or in a list, half the time: where the wire to the workers breaks.
bad_values = st.integers(0, 3).flatmap(
    lambda i: [st.sampled_from(_WIDTHS), st.lists(st.sampled_from(_WIDTHS), min_size=1, max_size=2), anything,
               anything][i]
)  # fmt: skip
# Plausible values too, so that some requests run and the bounds are probed from both sides.
PLAUSIBLE = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 5000),
    "seed": st.integers(0, 2**64 - 1),
    "max_tokens": st.integers(1, 12),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 5000), max_size=2),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "n": st.just(1),
}
NUMERIC = ["seed", "max_tokens", "top_k", "stop_token_ids", "temperature", "top_p", "max_completion_tokens"]
EXTRA = ["logprobs", "echo", "presence_penalty", "logit_bias", "best_of", "suffix", "guided_json", "guided_regex",
         "guided_choice", "structured_outputs", "response_format"]


def _fields(names: list[str]):
    """Plausible values for some of `names`, then one or two of them (or others) replaced by anything: a
    request with one bad field reaches further than one where everything is wrong."""
    plausible = st.fixed_dictionaries({}, optional={n: PLAUSIBLE[n] for n in names if n in PLAUSIBLE})
    numeric = [n for n in names if n in NUMERIC]
    one_numeric = st.dictionaries(st.sampled_from(numeric), bad_values, min_size=1, max_size=1)
    bad = mostly(one_numeric, st.dictionaries(st.sampled_from(names), anything, max_size=2))
    return st.builds(lambda good, worse: {**good, **worse}, plausible, bad)


def mostly(valid, other=anything):
    """`valid` three times in four: a request that is wrong everywhere stops at its first field."""
    return st.integers(0, 3).flatmap(lambda i: other if i == 0 else valid)


valid_prompts = st.sampled_from([CANARY, "import os"]) | st.lists(st.integers(1, 4000), min_size=1, max_size=4)
completion_bodies = st.builds(
    lambda prompt, fields: {"model": MODEL, "prompt": prompt, "max_tokens": 8, **fields},
    mostly(valid_prompts),
    _fields([*PLAUSIBLE, *EXTRA]),
)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]) | anything,
                                           "content": st.text(max_size=12) | anything}), min_size=1, max_size=2)
chat_bodies = st.builds(
    lambda msgs, kwargs, fields: {"model": MODEL, "messages": msgs, "max_tokens": 8, "chat_template_kwargs": kwargs,
                                  **fields},
    mostly(messages),
    st.none() | st.dictionaries(st.sampled_from(["add_generation_prompt", "messages", "x"]) | texts, anything,
                                max_size=2),
    _fields([*PLAUSIBLE, "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "response_format",
             "add_generation_prompt"]),
)  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, device="cpu",
                          speculative_config={"num_speculative_tokens": 2})  # fmt: skip
    with LocalStack(config, scheduler=scheduler_settings(http_port=free_port(), max_prompt_bytes=16 * 1024),
                    log_dir=tmp_path_factory.mktemp("logs")) as running:  # fmt: skip
        yield running


def _post(url: str, body: dict) -> tuple[int, bytes]:
    return services.post_json(url, json.dumps(body).encode())  # ensure_ascii: lone surrogates go as \udXXX


def _http_canary(stack) -> None:
    start = time.monotonic()
    status, raw = _post(stack.http_url + "/v1/completions", {"model": MODEL, "prompt": CANARY, "max_tokens": 4})
    assert status == 200, raw
    assert time.monotonic() - start < 15, "the canary was slow: the group was harmed"


def _check_http_answer(status: int, raw: bytes) -> None:
    assert status < 500, raw
    if status >= 400:
        error = json.loads(raw)["error"]  # OpenAI's shape, never FastAPI's {"detail": ...}
        assert error["message"] and error["type"], raw
    elif raw.startswith(b"data:"):
        assert b'"error"' not in raw, raw  # a stream that started must not end in a server error
        assert raw.rstrip().endswith(b"data: [DONE]"), raw


@FUZZ
@given(body=completion_bodies)
def test_completions_never_fail_the_server(stack, body) -> None:
    _check_http_answer(*_post(stack.http_url + "/v1/completions", body))
    _http_canary(stack)


@FUZZ
@given(body=chat_bodies)
def test_chat_completions_never_fail_the_server(stack, body) -> None:
    _check_http_answer(*_post(stack.http_url + "/v1/chat/completions", body))
    _http_canary(stack)


uint32 = st.sampled_from([0, 1, 4095, 4096, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1)
grpc_requests = st.builds(
    lambda prompt, sampling: pb.GenerateRequest(sampling=pb.SamplingParameters(**sampling), **prompt),
    st.one_of(st.just({"prompt": CANARY}), st.builds(lambda t: {"prompt": t}, st.text(max_size=8)),
              st.builds(lambda ids: {"prompt_token_ids": pb.TokenIds(ids=ids)}, st.lists(uint32, max_size=4))),
    st.fixed_dictionaries({}, optional={
        "temperature": st.floats(width=32), "top_p": st.floats(width=32),
        "top_k": st.sampled_from([-(2**31), -2, -1, 0, 1, 4096, 4097, 2**31 - 1]),
        "seed": st.sampled_from([0, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1),
        "max_tokens": st.sampled_from([-(2**31), -1, 0, 1, 8, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 2**31 - 1]),
        "stop": st.lists(st.text(max_size=3), max_size=2), "stop_token_ids": st.lists(uint32, max_size=2),
        "ignore_eos": st.booleans(),
    }),
)  # fmt: skip


def _check_grpc(address: str, request: pb.GenerateRequest) -> None:
    channel = grpc.insecure_channel(address)
    generate = channel.unary_stream("/minedraft.v1.MineDraft/Generate",
                                    request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateResponse.FromString)  # fmt: skip
    try:
        list(generate(request, timeout=120))
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, exc.code(), exc.details())
    finally:
        channel.close()
    start = time.monotonic()
    with Client(address, timeout=15, retries=0) as client:
        assert client.generate(CANARY, max_tokens=4, temperature=0).token_ids
    assert time.monotonic() - start < 15


@FUZZ
@given(request=grpc_requests)
def test_grpc_never_fails_the_server(stack, request) -> None:
    _check_grpc(stack.address, request)


@settings(FUZZ, max_examples=max(5, EXAMPLES // 2))
@given(request=grpc_requests)
def test_the_gateway_never_fails_the_server(gateway, request) -> None:
    _check_grpc(gateway, request)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_model_len=MAX_MODEL_LEN, speculative_config={"num_speculative_tokens": 2})


@FUZZ
@given(kwargs=_fields([name for name in PLAUSIBLE if name not in ("stream", "n")]))
def test_the_offline_api_refuses_or_runs_and_keeps_running(llm, kwargs) -> None:
    try:
        params = SamplingParams(**kwargs)
    except ValidationError:
        params = None
    if params is not None:
        try:
            llm.generate([CANARY], params)
        except ValueError as exc:
            assert any(field in str(exc) for field in ("max_tokens", "top_k", "stop_token_ids")), exc
    assert llm.generate([CANARY], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
