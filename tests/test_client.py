"""The gRPC client SDK (minedraft.client) against a real grpc server on 127.0.0.1.

The server here is `ScriptedFaults`, a double of the scheduler's public API that streams a fixed script of
deltas and fails where a test scripts it (UNAVAILABLE before or after the first message, a bearer token to
require, delays, a stream without a finish), so that retries, resumption, deadlines and cancellation are
driven exactly. The client is what is under test; it runs against the real service in the end-to-end tests
(test_services_e2e.py).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from minedraft.api import generate_pb2 as pb
from minedraft.api import generate_pb2_grpc
from minedraft.client import AsyncClient, Client, MineDraftError, RetryPolicy, SpecDecodeStats

from tls_certs import self_signed_cert

# (text, token ids) per message. Empty texts are where the server holds back the first bytes of a
# multi-byte UTF-8 character until the token that completes it: "é" (2 bytes), "世界" (3 each), "🙂" (4).
SCRIPT = [
    ("H", [10]),
    ("", [11]),
    ("éllo, ", [12, 13, 14]),
    ("世", [15, 16]),
    ("", [17, 18]),
    ("界 ", [19, 20]),
    ("🙂", [21, 22, 23]),
    ("!", [24]),
]
FULL_TEXT = "Héllo, 世界 🙂!"
FULL_IDS = list(range(10, 25))  # 15 ids: under the default max_tokens of 16, so the script ends with "stop"
STATS = pb.SpecDecodeStats(
    num_drafts=3, num_draft_tokens=9, num_accepted_tokens=6, num_accepted_tokens_per_pos=[3, 2, 1]
)
INFO = pb.ServerInfo(
    version="0.1.0", target_model="target", draft_model="draft", mode="minedraft",
    speculative_config_json='{"num_speculative_tokens": 3}', tensor_parallel_size=2, max_num_seqs=8,
    max_model_len=2048, max_waiting_requests=64, vocab_size=32000,
)  # fmt: skip
FAST_RETRY = RetryPolicy(max_attempts=5, initial_backoff=0.01)


class ScriptedFaults(generate_pb2_grpc.MineDraftServicer):
    """The MineDraft service's script and the faults a test sets through its attributes (`reset` clears them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.token: str | None = None  # required bearer token, if any
        self.unavailable_first = 0  # fail this many calls with UNAVAILABLE before answering
        self.fail_after_first = False  # UNAVAILABLE after the first message (must not be retried)
        self.break_once = False  # the first call only: UNAVAILABLE after its first message
        self.no_finish = False  # end the stream with OK but without a finish reason
        self.break_after_finish = False  # UNAVAILABLE after the final message (the server died before closing)
        self.delay = 0.0  # seconds before each message
        self.calls = 0
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled = threading.Event()  # a stream ended before its last message (client cancel, abort)

    def _admit(self, request: object, context: grpc.ServicerContext) -> None:
        with self._lock:
            self.calls += 1
            calls = self.calls
            self.requests.append(request)
            self.metadata.append(dict(context.invocation_metadata()))
        if self.token is not None and self.metadata[-1].get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        if calls <= self.unavailable_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        self._admit(request, context)
        sampling = request.sampling
        if sampling.HasField("temperature") and sampling.temperature < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0")
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
        chunks, total, skip = [], 0, sampling.resumed_tokens  # a resumed request continues the script
        for text, ids in SCRIPT:
            if skip > 0:
                skip -= len(ids)
                continue
            if total + len(ids) > max_tokens:
                break
            chunks.append((text, ids))
            total += len(ids)
        # grpc stops pulling from this generator once the client cancels, so the check sits in a callback.
        sent = [0]
        context.add_callback(lambda: sent[0] < len(chunks) and self.cancelled.set())
        for i, (text, ids) in enumerate(chunks):
            time.sleep(self.delay)
            if i == 1 and (self.fail_after_first or (self.break_once and self.calls == 1)):
                context.abort(grpc.StatusCode.UNAVAILABLE, "worker lost")
            msg = pb.GenerateResponse(request_id=request.request_id or "req-1", text=text, token_ids=ids)
            if i == len(chunks) - 1 and not self.no_finish:
                self._finish(msg, request, length=len(chunks) < len(SCRIPT), completion_tokens=total)
            yield msg
            sent[0] += 1
        if self.break_after_finish:
            context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler lost")

    def _finish(self, msg: pb.GenerateResponse, request: pb.GenerateRequest, length: bool, completion_tokens: int):
        msg.finish_reason = pb.FINISH_REASON_LENGTH if length else pb.FINISH_REASON_STOP
        is_ids = request.WhichOneof("input") == "prompt_token_ids"
        prompt_tokens = len(request.prompt_token_ids.ids) if is_ids else len(request.prompt.split())
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens))
        msg.spec_decode_stats.CopyFrom(STATS)

    def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.ServicerContext) -> pb.ServerInfo:
        self._admit(request, context)
        return INFO


def _start_server(
    servicer: ScriptedFaults, health_servicer: health.HealthServicer, creds: grpc.ServerCredentials | None = None
) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generate_pb2_grpc.add_MineDraftServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bind = "127.0.0.1:0"
    port = server.add_insecure_port(bind) if creds is None else server.add_secure_port(bind, creds)
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ScriptedFaults, health.HealthServicer, str]]:
    servicer, health_servicer = ScriptedFaults(), health.HealthServicer()
    grpc_server, address = _start_server(servicer, health_servicer)
    yield servicer, health_servicer, address
    grpc_server.stop(grace=None)


@pytest.fixture
def scripted(server: tuple[ScriptedFaults, health.HealthServicer, str]) -> ScriptedFaults:
    servicer, health_servicer, _ = server
    servicer.reset()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return servicer


@pytest.fixture
def address(server: tuple[ScriptedFaults, health.HealthServicer, str], scripted: ScriptedFaults) -> str:
    return server[2]


def _check_full_completion(completion) -> None:
    assert completion.text == FULL_TEXT
    assert completion.token_ids == FULL_IDS
    assert completion.finish_reason == "stop"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (2, 15)
    stats = completion.spec_decode_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 6)
    assert stats.num_accepted_tokens_per_pos == (3, 2, 1)
    assert stats.mean_accepted_length == pytest.approx(3.0)
    assert completion.request_id == "req-1"


def _check_deltas(deltas) -> None:
    assert [(d.text, d.token_ids) for d in deltas] == SCRIPT
    assert all(d.finish_reason is None and d.usage is None and d.spec_decode_stats is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == "stop"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (2, 15)
    assert last.spec_decode_stats.num_accepted_tokens == 6


# --- sync client -------------------------------------------------------------------------------------------


def test_generate_concatenates_the_stream(address: str) -> None:
    with Client(address) as client:
        _check_full_completion(client.generate("Hello there"))


def test_stream_yields_deltas_with_the_final_one_carrying_the_stats(address: str) -> None:
    with Client(address) as client:
        _check_deltas(list(client.stream("Hello there")))


def test_length_finish_and_token_id_prompt(address: str, scripted: ScriptedFaults) -> None:
    with Client(address) as client:
        completion = client.generate([1, 2, 3], max_tokens=4)
    assert (completion.text, completion.token_ids, completion.finish_reason) == ("H", [10, 11], "length")
    assert completion.usage.prompt_tokens == 3
    request = scripted.requests[-1]
    assert request.WhichOneof("input") == "prompt_token_ids" and list(request.prompt_token_ids.ids) == [1, 2, 3]


def test_only_the_sampling_fields_the_caller_set_are_sent(address: str, scripted: ScriptedFaults) -> None:
    with Client(address) as client:
        client.generate("a b")
        client.generate("a b", temperature=0.0, top_p=0.5, top_k=5, seed=7, stop="\n", max_tokens=32, ignore_eos=True)
    default, custom = (r.sampling for r in scripted.requests)
    assert not any(default.HasField(f) for f in ("temperature", "top_p", "top_k", "seed", "max_tokens"))
    assert list(default.stop) == [] and not default.ignore_eos
    assert all(custom.HasField(f) for f in ("temperature", "top_p", "top_k", "seed", "max_tokens"))
    assert (custom.temperature, custom.top_p, custom.top_k, custom.seed, custom.max_tokens) == (0.0, 0.5, 5, 7, 32)
    assert list(custom.stop) == ["\n"] and custom.ignore_eos
    assert scripted.requests[0].prompt == "a b"


def test_bad_prompt_type_fails_before_any_call(address: str, scripted: ScriptedFaults) -> None:
    with Client(address) as client, pytest.raises(TypeError):
        client.generate(3.5)  # type: ignore[arg-type]
    assert scripted.calls == 0


def test_invalid_argument_surfaces_with_code_and_details(address: str, scripted: ScriptedFaults) -> None:
    with Client(address) as client, pytest.raises(grpc.RpcError) as info:
        client.generate("x", temperature=-1.0)
    assert isinstance(info.value, MineDraftError)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "temperature must be >= 0"
    assert scripted.calls == 1  # not retried


def test_bearer_token_is_sent_on_every_call(address: str, scripted: ScriptedFaults) -> None:
    scripted.token = "s3cret"
    with Client(address) as client, pytest.raises(MineDraftError) as info:
        client.generate("x")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(address, token="s3cret") as client:
        assert client.generate("x").text == FULL_TEXT
        assert client.server_info().mode == "minedraft"
    assert [m.get("authorization") for m in scripted.metadata] == [None, "Bearer s3cret", "Bearer s3cret"]


def test_server_info_and_health(server, address: str, scripted: ScriptedFaults) -> None:
    scripted.unavailable_first = 1  # unary calls are retried too
    with Client(address, retries=FAST_RETRY) as client:
        info = client.server_info()
        assert (info.target_model, info.draft_model, info.tensor_parallel_size, info.vocab_size) == (
            "target", "draft", 2, 32000,
        )  # fmt: skip
        assert info.speculative_config == {"num_speculative_tokens": 3}
        assert client.health()
        server[1].set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert not client.health()
        with pytest.raises(MineDraftError) as err:
            client.health("no.such.Service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert scripted.calls == 2


def test_unavailable_is_retried_until_the_first_message(address: str, scripted: ScriptedFaults) -> None:
    scripted.unavailable_first = 2
    with Client(address, retries=FAST_RETRY) as client:
        assert client.generate("x").text == FULL_TEXT
    assert scripted.calls == 3


def test_retries_are_bounded(address: str, scripted: ScriptedFaults) -> None:
    scripted.unavailable_first = 100
    with Client(address, retries=2) as client, pytest.raises(MineDraftError) as info:
        client.generate("x")
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, "warming up")
    assert scripted.calls == 3
    scripted.reset()
    scripted.unavailable_first = 100
    with Client(address, retries=0) as client, pytest.raises(MineDraftError):
        client.generate("x")
    assert scripted.calls == 1


def test_no_retry_after_the_first_message(address: str, scripted: ScriptedFaults) -> None:
    scripted.fail_after_first = True
    with Client(address, retries=FAST_RETRY) as client:
        stream = client.stream("x")
        assert next(stream).text == "H"
        with pytest.raises(MineDraftError) as info:
            next(stream)
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, "worker lost")
        with pytest.raises(MineDraftError):
            client.generate("x")
    assert scripted.calls == 2  # one per call: neither retried


def test_a_stream_that_breaks_after_its_final_message_is_whole(address: str, scripted: ScriptedFaults) -> None:
    """The server died between the final message and the stream's close: the caller has the whole output, with
    or without resumption (a text prompt), and nothing is submitted again."""
    scripted.break_after_finish = True
    with Client(address, retries=FAST_RETRY) as client:
        _check_full_completion(client.generate("Hello there"))
        completion = client.generate([1, 2, 3])
        assert (completion.token_ids, completion.finish_reason) == (FULL_IDS, "stop")
    assert scripted.calls == 2


def test_a_token_id_stream_that_breaks_is_resumed_where_it_broke(address: str, scripted: ScriptedFaults) -> None:
    """Resubmitted as the gateway migrates a request: prompt + tokens received, marked resumed, the rest of
    max_tokens, and the seed the client pinned on the first submission; the caller sees one stream."""
    scripted.break_once = True
    with Client(address, retries=FAST_RETRY) as client:
        deltas = list(client.stream([1, 2, 3], top_k=5))
    _check_resumed(deltas, scripted)


def test_async_stream_that_breaks_is_resumed_where_it_broke(address: str, scripted: ScriptedFaults) -> None:
    async def main() -> list:
        async with AsyncClient(address, retries=FAST_RETRY) as client:
            return [d async for d in client.stream([1, 2, 3], top_k=5)]

    scripted.break_once = True
    _check_resumed(asyncio.run(main()), scripted)


def _check_resumed(deltas: list, scripted: ScriptedFaults) -> None:
    assert "".join(d.text for d in deltas) == FULL_TEXT
    assert [t for d in deltas for t in d.token_ids] == FULL_IDS
    assert deltas[-1].usage.prompt_tokens == 3 and deltas[-1].usage.completion_tokens == len(FULL_IDS)
    first, second = scripted.requests
    assert first.sampling.HasField("seed") and second.sampling.seed == first.sampling.seed
    assert list(second.prompt_token_ids.ids) == [1, 2, 3, 10]
    assert (second.sampling.resumed_tokens, second.sampling.max_tokens, second.sampling.top_k) == (1, 15, 5)


def test_a_text_or_stop_string_stream_is_not_resumed(address: str, scripted: ScriptedFaults) -> None:
    """A text prompt's token ids are known to the server alone; text held back for a stop string at the break
    was never sent: neither could be resumed exactly, so the break surfaces."""
    for prompt, stop in (("x", None), ([1, 2, 3], "?")):
        scripted.reset()
        scripted.break_once = True
        with Client(address, retries=FAST_RETRY) as client, pytest.raises(MineDraftError) as info:
            list(client.stream(prompt, stop=stop))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and scripted.calls == 1


def test_retries_respect_the_overall_deadline(address: str, scripted: ScriptedFaults) -> None:
    scripted.unavailable_first = 1000
    policy = RetryPolicy(max_attempts=1000, initial_backoff=0.05, multiplier=1.0, jitter=0.0)
    start = time.monotonic()
    with Client(address, retries=policy, timeout=0.3) as client, pytest.raises(MineDraftError) as info:
        client.generate("x")
    elapsed = time.monotonic() - start
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # the real cause, seen before the deadline
    assert elapsed < 0.3 + 0.5 and 2 <= scripted.calls < 10


def test_deadline_exceeded_surfaces_and_is_overridable_per_call(address: str, scripted: ScriptedFaults) -> None:
    scripted.delay = 0.05  # the whole script takes 0.4 s
    with Client(address, timeout=0.15) as client:
        with pytest.raises(MineDraftError) as info:
            client.generate("x")
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert client.generate("x", timeout=None).text == FULL_TEXT
        assert client.generate("x", timeout=5.0).text == FULL_TEXT


def test_stopping_a_stream_early_cancels_the_call(address: str, scripted: ScriptedFaults) -> None:
    scripted.delay = 0.05
    with Client(address) as client:
        for delta in client.stream("x"):
            assert delta.text == "H"
            break
        assert scripted.cancelled.wait(timeout=5)


def test_stream_ending_without_a_finish_reason_is_an_error(address: str, scripted: ScriptedFaults) -> None:
    scripted.no_finish = True
    with Client(address) as client, pytest.raises(MineDraftError) as info:
        client.generate("x")
    assert info.value.code() == grpc.StatusCode.UNKNOWN


# --- async client ------------------------------------------------------------------------------------------


def test_async_generate_stream_info_and_health(address: str, scripted: ScriptedFaults) -> None:
    scripted.token = "t"

    async def main() -> None:
        async with AsyncClient(address, token="t") as client:
            _check_full_completion(await client.generate("Hello there"))
            _check_deltas([d async for d in client.stream("Hello there")])
            assert (await client.server_info()).max_model_len == 2048
            assert await client.health()

    asyncio.run(main())
    assert all(m["authorization"] == "Bearer t" for m in scripted.metadata)


def test_async_errors_and_retries(address: str, scripted: ScriptedFaults) -> None:
    async def main() -> None:
        async with AsyncClient(address, retries=FAST_RETRY) as client:
            with pytest.raises(TypeError):
                client.stream(b"bytes are not a prompt")  # type: ignore[arg-type]
            with pytest.raises(MineDraftError) as info:
                await client.generate("x", temperature=-1.0)
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0",
            )  # fmt: skip
            assert scripted.calls == 1

            scripted.reset()
            scripted.unavailable_first = 2
            assert (await client.generate("x")).text == FULL_TEXT
            assert scripted.calls == 3

            scripted.reset()
            scripted.fail_after_first = True
            received = []
            with pytest.raises(MineDraftError) as info:
                async for delta in client.stream("x"):
                    received.append(delta.text)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert received == ["H"] and scripted.calls == 1

    asyncio.run(main())


def test_async_deadline_and_early_close(address: str, scripted: ScriptedFaults) -> None:
    scripted.delay = 0.05

    async def main() -> None:
        async with AsyncClient(address, timeout=0.15) as client:
            with pytest.raises(MineDraftError) as info:
                await client.generate("x")
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert (await client.generate("x", timeout=None)).text == FULL_TEXT
            scripted.cancelled.clear()
            async for _ in client.stream("x", timeout=None):
                break
        assert await asyncio.get_running_loop().run_in_executor(None, scripted.cancelled.wait, 5)

    asyncio.run(main())


# --- pieces without a server -------------------------------------------------------------------------------


def test_backoff_doubles_with_bounded_jitter() -> None:
    policy, rng = RetryPolicy(), random.Random(0)
    for attempt, base in enumerate([0.1, 0.2, 0.4, 0.8], start=1):
        assert base * 0.8 <= policy.backoff(attempt, rng) <= base * 1.2
    assert RetryPolicy(max_backoff=1.0, jitter=0.0).backoff(10) == 1.0
    assert RetryPolicy.coerce(None).max_attempts == RetryPolicy.coerce(0).max_attempts == 1
    assert RetryPolicy.coerce(3).max_attempts == 4


def test_mean_accepted_length_without_drafts_is_zero() -> None:
    assert SpecDecodeStats().mean_accepted_length == 0.0


def test_importing_the_client_does_not_import_torch() -> None:
    code = "import sys, minedraft.client; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- TLS ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ScriptedFaults, str, Path]]:
    """The test double behind TLS with a throwaway self-signed certificate for 127.0.0.1."""
    key_pem, cert_pem = self_signed_cert()
    cert_path = tmp_path_factory.mktemp("tls") / "ca.pem"
    cert_path.write_bytes(cert_pem)
    servicer = ScriptedFaults()
    creds = grpc.ssl_server_credentials([(key_pem, cert_pem)])
    grpc_server, address = _start_server(servicer, health.HealthServicer(), creds)
    yield servicer, address, cert_path
    grpc_server.stop(grace=None)


def test_tls_with_a_root_certificate_path_or_credentials(tls_server) -> None:
    servicer, address, cert_path = tls_server
    servicer.token = "t"
    with Client(address, tls=cert_path, token="t") as client:
        _check_full_completion(client.generate("Hello there"))
    with Client(address, tls=grpc.ssl_channel_credentials(cert_path.read_bytes()), token="t") as client:
        assert client.server_info().mode == "minedraft"

    async def main() -> bool:
        async with AsyncClient(address, tls=str(cert_path)) as client:
            return await client.health()

    assert asyncio.run(main())


def test_tls_with_system_roots_rejects_an_untrusted_server(tls_server) -> None:
    _, address, _ = tls_server
    with Client(address, tls=True, retries=0, timeout=5) as client, pytest.raises(MineDraftError) as info:
        client.health()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
