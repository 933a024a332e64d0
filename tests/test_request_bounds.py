"""Out-of-range and ill-typed requests are refused at the edge, naming the field; none harms the group.

Every request of the probe that once stopped a whole engine group (a seed of -1 made each new world fail
again) is sent over HTTP, gRPC and through the gateway, each followed by a canary that must succeed at
once. The static bounds are SamplingParams' own (what the wire to the workers can carry); the model's
bounds (vocabulary, context) are the engine's.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import time
import urllib.parse

import grpc
import pytest
from pydantic import ValidationError

from minedraft import LLM
from minedraft.api import generate_pb2 as pb
from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.sampling.params import SamplingParams
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

import services

MODEL = "minedraft-target"  # the bundled pair's served name
VOCAB = 4096
MAX_MODEL_LEN = 256
MAX_PROMPT_BYTES = 64 * 1024
CANARY = "def main():"

# (body fields, the field the refusal must name): the probe, and its neighbours.
HTTP_PROBE = [
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
    ({"max_tokens": 1e12}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**32]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"temperature": 1e39}, "temperature"),
    ({"top_p": 1e-50}, "top_p"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [VOCAB]}, "prompt"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"n": True}, "n"),
]


def _raw_json(fields: dict) -> bytes:
    return json.dumps({"model": MODEL, "prompt": CANARY, "max_tokens": 4, **fields}).encode()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, device="cpu",
                          speculative_config={"num_speculative_tokens": 2})  # fmt: skip
    with LocalStack(config, scheduler=scheduler_settings(http_port=free_port(), max_prompt_bytes=MAX_PROMPT_BYTES),
                    log_dir=tmp_path_factory.mktemp("logs")) as running:  # fmt: skip
        yield running


def _post(stack, path: str, body: bytes) -> tuple[int, dict]:
    return services.post_for_json(stack.http_url + path, body)


def _http_canary(stack) -> None:
    start = time.monotonic()
    status, body = _post(stack, "/v1/completions", _raw_json({"temperature": 0}))
    assert status == 200 and body["choices"][0]["text"], body
    assert time.monotonic() - start < 10, "the canary was slow: the group was harmed"


def _grpc_canary(address: str) -> None:
    with Client(address, timeout=10, retries=0) as client:
        assert client.generate(CANARY, max_tokens=4, temperature=0).token_ids


def _assert_names(body: dict, field: str) -> None:
    error = body["error"]
    assert field in error["message"] or field == (error["param"] or "").split(".")[0], body
    assert error["type"] == "invalid_request_error"


# --- static bounds, no server -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"seed": -1}, {"seed": 2**64}, {"max_tokens": 2**31}, {"max_tokens": True}, {"top_k": 2**31}, {"top_k": 0},
     {"stop_token_ids": [-1]}, {"stop_token_ids": [2**32]}, {"stop_token_ids": True}, {"temperature": float("nan")},
     {"temperature": 1e39}, {"temperature": -0.5}, {"top_p": 1e-50}, {"top_p": 1.5}, {"stop": ["\ud800"]},
     {"stop": [""]}, {"ignore_eos": 1}, {"seed": 1.0}],
)  # fmt: skip
def test_sampling_params_refuse_what_the_wire_cannot_carry(kwargs) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)) in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [{"seed": 0}, {"seed": 2**64 - 1}, {"max_tokens": 2**31 - 1}, {"top_k": 2**31 - 1}, {"stop_token_ids": [2**32 - 1]},
     {"temperature": 0}, {"temperature": 3e38}, {"top_p": 1e-30}, {"stop": "x"}, {"stop_token_ids": 5}],
)  # fmt: skip
def test_sampling_params_take_the_whole_range(kwargs) -> None:
    SamplingParams(**kwargs)


def test_the_offline_api_refuses_model_bounds_and_keeps_serving() -> None:
    llm = LLM(device="cpu", max_model_len=MAX_MODEL_LEN)
    for kwargs, field in [({"max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"), ({"top_k": VOCAB + 1}, "top_k"),
                          ({"stop_token_ids": [VOCAB]}, "stop_token_ids")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            llm.generate([CANARY], SamplingParams(temperature=0, **kwargs))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[VOCAB]], SamplingParams(temperature=0))
    assert llm.generate([CANARY], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids


# --- the probe, over every edge -----------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "field"), HTTP_PROBE, ids=[json.dumps(f)[:40] for f, _ in HTTP_PROBE])
def test_http_probe_is_a_400_naming_the_field(stack, fields, field) -> None:
    status, body = _post(stack, "/v1/completions", _raw_json(fields))
    assert status == 400, body
    _assert_names(body, field)
    _http_canary(stack)


@pytest.mark.parametrize("stream", [False, True])
def test_a_streamed_request_out_of_range_is_refused_before_the_stream(stack, stream) -> None:
    status, body = _post(stack, "/v1/completions", _raw_json({"max_tokens": MAX_MODEL_LEN + 1, "stream": stream}))
    assert status == 400 and "max_tokens" in body["error"]["message"]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "%s", "prompt": "def f(\\ud800):", "max_tokens": 4}' % MODEL.encode(),
        b'{"model": "%s", "prompt": "x", "stop": ["\\udfff"], "max_tokens": 4}' % MODEL.encode(),
    ],
)
def test_a_lone_surrogate_is_a_400(stack, raw) -> None:
    status, body = _post(stack, "/v1/completions", raw)
    assert status == 400 and "surrogate" in body["error"]["message"], body
    _http_canary(stack)


def test_a_lone_surrogate_in_a_chat_message_is_a_400(stack) -> None:
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud83d"}]}' % MODEL.encode()
    status, body = _post(stack, "/v1/chat/completions", raw)
    assert status == 400 and "surrogate" in body["error"]["message"], body


def test_chat_template_kwargs_override_or_are_refused(stack) -> None:
    def chat(**extra) -> tuple[int, dict]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "def f():"}], "max_tokens": 4, **extra}
        return _post(stack, "/v1/chat/completions", json.dumps(body).encode())

    status, body = chat(chat_template_kwargs={"add_generation_prompt": False})  # as vLLM: the kwargs win
    assert status == 200, body
    status, body = chat(chat_template_kwargs={"messages": []})
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs.messages", body
    status, body = chat(max_completion_tokens=True)
    assert status == 400 and "max_completion_tokens" in body["error"]["message"], body
    _http_canary(stack)


def test_a_chunked_body_over_the_limit_is_a_413_in_openai_shape(stack) -> None:
    """50 MB sent chunked (no declared length): refused once the limit is crossed, in OpenAI's error shape."""
    connection = http.client.HTTPConnection(urllib.parse.urlsplit(stack.http_url).netloc, timeout=60)
    chunk = b"x" * (1 << 20)
    body = iter([b'{"model": "%s", "prompt": "' % MODEL.encode()] + [chunk] * 50 + [b'"}'])
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it answered and stopped reading
        connection.request("POST", "/v1/completions", body=body, encode_chunked=True,
                           headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})  # fmt: skip
    response = connection.getresponse()
    payload = json.loads(response.read())
    connection.close()
    assert response.status == 413 and "larger than this server accepts" in payload["error"]["message"], payload
    _http_canary(stack)


def test_unknown_routes_answer_in_openai_shape(stack) -> None:
    status, body = _post(stack, "/v1/nothing", b"{}")
    assert status == 404 and body["error"]["message"], body


def _grpc_probe() -> list[tuple[dict, str]]:
    """What gRPC can carry of the probe (its proto types bound the rest): ranges only the model bounds."""
    return [
        ({"max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
        ({"top_k": VOCAB + 1}, "top_k"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
    ]


@pytest.mark.parametrize("edge", ["scheduler", "gateway"])
def test_grpc_probe_is_invalid_argument_naming_the_field(stack, gateway, edge) -> None:
    address = stack.address if edge == "scheduler" else gateway
    channel = grpc.insecure_channel(address)
    generate = channel.unary_stream(
        "/minedraft.v1.MineDraft/Generate",
        request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    probes = _grpc_probe() + [({"prompt_token_ids": [VOCAB]}, "prompt")]
    for fields, field in probes:
        ids = fields.pop("prompt_token_ids", None)
        request = pb.GenerateRequest(sampling=pb.SamplingParameters(**{"max_tokens": 4, **fields}))
        if ids is not None:
            request.prompt_token_ids.ids.extend(ids)
        else:
            request.prompt = CANARY
        with pytest.raises(grpc.RpcError) as info:
            list(generate(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, info.value.details())
        assert field in info.value.details(), (fields, info.value.details())
        _grpc_canary(address)
    channel.close()


@pytest.mark.parametrize("edge", ["scheduler", "gateway"])
def test_grpc_fields_the_server_does_not_know_are_refused(stack, gateway, edge) -> None:
    """A client built from a newer generate.proto may send an option this server would silently skip."""
    address = stack.address if edge == "scheduler" else gateway
    unknown = b"\x98\x06\x01"  # field 99, varint 1
    sampling = pb.SamplingParameters.FromString(pb.SamplingParameters(max_tokens=4).SerializeToString() + unknown)
    with grpc.insecure_channel(address) as channel:
        generate = channel.unary_stream("/minedraft.v1.MineDraft/Generate", request_serializer=bytes,
                                        response_deserializer=pb.GenerateResponse.FromString)  # fmt: skip
        for request in (pb.GenerateRequest(prompt=CANARY, sampling=sampling).SerializeToString(),
                        pb.GenerateRequest(prompt=CANARY).SerializeToString() + unknown):  # fmt: skip
            with pytest.raises(grpc.RpcError) as info:
                list(generate(request, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "field number 99: unknown to this server" in info.value.details()
    _grpc_canary(address)
