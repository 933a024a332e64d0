"""What the public frontends refuse, on both protocols, without harming the requests already running.

One stack for the module: the bundled target alone (ar), one request per batch, so that a single long
request holds the only running slot and every other admitted request provably waits.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from minedraft.api import generate_pb2 as pb
from minedraft.client import Client, MineDraftError
from minedraft.config import EngineConfig
from minedraft.frontends.auth import ApiKeys
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

import services

MAX_PROMPT_BYTES = 16 * 1024
MAX_WAITING = 4
BYSTANDER = "import os\n\n\ndef main():"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = EngineConfig(max_num_seqs=1, device="cpu", batch_invariant=True)
    settings = scheduler_settings(
        http_port=free_port(), max_waiting_requests=MAX_WAITING, max_prompt_bytes=MAX_PROMPT_BYTES
    )
    with LocalStack(config, scheduler=settings, log_dir=tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.address, retries=0, timeout=300) as c:
        yield c


def _post(stack, path: str, body: bytes) -> tuple[int, dict]:
    return services.post_for_json(stack.http_url + path, body)


def _declare_body(stack, path: str, size: int) -> tuple[int, dict]:
    """Announce a body of `size` bytes and wait for the answer before sending it (a 413 comes first)."""
    connection = http.client.HTTPConnection(urllib.parse.urlsplit(stack.http_url).netloc, timeout=60)
    try:
        connection.putrequest("POST", path)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(size))
        connection.endheaders()
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _completion(prompt: str, **fields) -> bytes:
    return json.dumps({"model": "minedraft-target", "prompt": prompt, "max_tokens": 4, **fields}).encode()


class _LongRequest:
    """A stream that holds the only running slot until cancelled (first delta = it is running)."""

    def __init__(self, client: Client, request_id: str | None = None) -> None:
        self._stream = client.stream("def f():", max_tokens=1000, temperature=0, ignore_eos=True,
                                     request_id=request_id)  # fmt: skip
        self.first = next(self._stream)

    def cancel(self) -> None:
        self._stream.close()  # stopping a stream early cancels its RPC


def _code(fn) -> str:
    try:
        fn()
        return "ok"
    except MineDraftError as exc:
        return exc.code().name


def test_oversized_prompts_are_refused_and_harm_no_running_stream(stack, client) -> None:
    alone = client.generate(BYSTANDER, max_tokens=48, temperature=0).text
    bystander: list[str] = []
    thread = threading.Thread(target=lambda: bystander.extend(
        d.text for d in client.stream(BYSTANDER, max_tokens=48, temperature=0)))  # fmt: skip
    thread.start()
    over = "x" * (MAX_PROMPT_BYTES + 1)
    with pytest.raises(MineDraftError) as info:
        client.generate(over, max_tokens=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-prompt-bytes" in info.value.details()
    with pytest.raises(MineDraftError) as info:  # far beyond: refused by gRPC before the message is parsed
        client.generate("y" * (4 * 1024 * 1024), max_tokens=2)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status, body = _post(stack, "/v1/completions", _completion(over))
    assert status == 400 and "--max-prompt-bytes" in body["error"]["message"]
    status, body = _declare_body(stack, "/v1/completions", 4 * 1024 * 1024)
    assert status == 413 and body["error"]["type"] == "invalid_request_error"
    thread.join(timeout=300)
    assert "".join(bystander) == alone


@pytest.mark.parametrize(
    ("method", "data"),
    [
        ("Generate", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"),  # a length varint that never ends
        ("Generate", b"\x12\x02\xff\xfe"),  # prompt: bytes that are not UTF-8
        ("GetServerInfo", b"\xff"),
    ],
)
@pytest.mark.parametrize("edge", ["scheduler", "gateway"])
def test_undecodable_request_bytes_are_invalid_argument(stack, gateway, edge: str, method: str, data: bytes) -> None:
    with grpc.insecure_channel(stack.address if edge == "scheduler" else gateway) as channel:
        path = f"/minedraft.v1.MineDraft/{method}"
        if method == "Generate":
            call = channel.unary_stream(path, response_deserializer=pb.GenerateResponse.FromString)
            with pytest.raises(grpc.RpcError) as info:
                list(call(data, timeout=30))
        else:
            call = channel.unary_unary(path, response_deserializer=pb.ServerInfo.FromString)
            with pytest.raises(grpc.RpcError) as info:
                call(data, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot decode" in info.value.details()


def test_a_request_id_in_flight_is_already_exists(client) -> None:
    running = _LongRequest(client, request_id="job-1")
    try:
        with pytest.raises(MineDraftError) as info:
            client.generate("x", max_tokens=2, request_id="job-1")
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "job-1" in info.value.details()
    finally:
        running.cancel()
    first = client.generate("x", max_tokens=2, request_id="job-2")
    assert first.request_id == "job-2"
    assert client.generate("x", max_tokens=2, request_id="job-2").request_id == "job-2"  # free once finished


def _burst(client: Client, send, n: int = 12) -> list:
    """`n` requests at once while one long request holds the only slot; results once all are answered.

    The refused answer at once; the admitted wait for the slot. The slot is freed only when n - MAX_WAITING
    have answered: had the server admitted more, fewer would answer and the extra ones would show as "ok".
    """
    running = _LongRequest(client)
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(send) for _ in range(n)]
        try:
            deadline = time.monotonic() + 120
            while sum(f.done() for f in futures) < n - MAX_WAITING and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            running.cancel()
        return [f.result() for f in futures]


def test_the_waiting_limit_holds_exactly_at_admission(stack, client) -> None:
    """With the only slot held, exactly MAX_WAITING of a burst are admitted, on either protocol."""
    codes = _burst(client, lambda: _code(lambda: client.generate("x", max_tokens=1)))
    assert codes.count("ok") == MAX_WAITING
    assert set(codes) == {"ok", "RESOURCE_EXHAUSTED"}
    statuses = _burst(client, lambda: _post(stack, "/v1/completions", _completion("x"))[0])
    assert statuses.count(200) == MAX_WAITING
    assert set(statuses) == {200, 429}


def _generated_tokens(stack) -> float:
    with urllib.request.urlopen(stack.http_url + "/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("minedraft:generation_tokens_total "):
                return float(line.split()[1])
    raise AssertionError("no minedraft:generation_tokens_total in /metrics")


def test_a_closed_http_stream_is_aborted(stack, client) -> None:
    """Closing the SSE stream aborts the request: the next request (queued behind it, one slot) finishes
    long before the closed one could have produced its 1000 tokens."""
    before = _generated_tokens(stack)
    api = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)
    stream = api.completions.create(model="minedraft-target", prompt="def f():", max_tokens=1000, stream=True,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))
    stream.close()
    assert client.generate("x", max_tokens=2, temperature=0).usage.completion_tokens == 2
    assert _generated_tokens(stack) - before < 1000


def test_api_keys_from_flags_files_and_the_environment(tmp_path, monkeypatch) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("from-file\n\n  second  \n")
    monkeypatch.setenv("MINEDRAFT_API_KEYS", "env-1,env-2")
    keys = ApiKeys.load(["flag"], [key_file])
    for key in ("flag", "from-file", "second", "env-1", "env-2"):
        assert keys.allows(f"Bearer {key}")
    assert not keys.allows("Bearer nope") and not keys.allows("flag") and not keys.allows(None)
    assert ApiKeys().allows(None)  # no keys: authentication is off
