"""Two engine groups behind `minedraft gateway`, as real local processes.

Greedy output through the gateway must equal the offline autoregressive output token for token and text
byte for byte (stop strings included), when both groups serve and when one whole group is SIGKILLed
mid-stream (its requests migrate to the other). Strict kernels: a migrated request is re-prefilled.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest

from minedraft.client import Client, RetryPolicy
from minedraft.config import EngineConfig
from minedraft.engine.engine import LLMEngine
from minedraft.sampling.params import SamplingParams
from minedraft.settings import GatewaySettings
from minedraft.stack.gateway import GatewayStack
from minedraft.stack.local import free_port, scheduler_settings

from conftest import tiny_config
from services import children, overload_codes

NUM_STREAMS = 32
MAX_TOKENS = 100


PAIR_SEED = 5  # conftest's `pair` from this seed


def _config(pair, speculative: bool = True) -> EngineConfig:
    spec = {"num_speculative_tokens": 3, "is_parallel": True} if speculative else None
    return tiny_config(pair, spec, max_num_seqs=16)


def _prompts() -> list[list[int]]:
    return [[(11 * i + j) % 300 + 1 for j in range(1 + i % 5)] for i in range(NUM_STREAMS)]


def _penalties(prompt: list[int]) -> dict[str, float]:
    """About one stream in four is penalised: after a migration the penalties must count the output the dead
    group produced as output (the gateway's resumed_tokens), or the text would change."""
    return {"presence_penalty": 0.8, "frequency_penalty": 0.4} if prompt[0] % 4 == 0 else {}


def _offline(pair, prompts, stops) -> list[tuple[list[int], str, str]]:
    engine = LLMEngine.local(_config(pair, speculative=False))
    requests = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=s,
                                             **_penalties(p)))
        for p, s in zip(prompts, stops, strict=True)
    ]
    while engine.has_unfinished():
        engine.step()
    return [(r.output_ids, r.text, r.finish_reason) for r in requests]


@pytest.fixture(scope="module")
def cases(pair) -> list[tuple[list[int], list[str] | None, tuple[list[int], str, str]]]:
    """(prompt, stop strings, offline output): every other stream stops on 3 characters of its own text
    taken late in it, so that the stop often comes after a migration or spans its seam."""
    prompts = _prompts()
    plain = _offline(pair, prompts, [None] * NUM_STREAMS)
    stops = []
    for i, (_, text, _) in enumerate(plain):
        at = int(len(text) * 0.7)
        stops.append([text[at : at + 3]] if i % 2 and len(text) > 10 else None)
    expected = _offline(pair, prompts, stops)
    assert sum(1 for _, _, reason in expected if reason == "stop") >= NUM_STREAMS // 4  # stops are exercised
    assert any(ord(c) > 127 for _, text, _ in expected for c in text)  # so are multi-byte characters
    return list(zip(prompts, stops, expected, strict=True))


@pytest.fixture(scope="module")
def stack(pair, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("gateway-logs")
    with GatewayStack(_config(pair), 2, metrics_ports=[free_port(), free_port()], log_dir=log_dir) as stack:
        yield stack


class Load:
    """NUM_STREAMS greedy streams in the background; `wait_for_tokens` lets a test strike mid-stream."""

    def __init__(self, address: str, cases, retries: RetryPolicy | int = 0, timeout: float | None = 240) -> None:
        self.tokens = 0
        self._lock = threading.Lock()
        self._client = Client(address, timeout=timeout, retries=retries)
        self._pool = ThreadPoolExecutor(len(cases))
        self._results = [self._pool.submit(self._one, prompt, stop) for prompt, stop, _ in cases]

    def _one(self, prompt: list[int], stop: list[str] | None) -> tuple[list[int], str, str]:
        ids: list[int] = []
        text = ""
        reason = ""
        for delta in self._client.stream(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=stop,
                                         **_penalties(prompt)):
            ids += delta.token_ids
            text += delta.text
            reason = delta.finish_reason or reason
            with self._lock:
                self.tokens += len(delta.token_ids)
        return ids, text, reason

    def wait_for_tokens(self, n: int, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tokens < n:
            assert time.monotonic() < deadline, f"only {self.tokens} tokens after {timeout_s}s"
            time.sleep(0.01)

    def results(self) -> list[tuple[list[int], str, str]]:
        try:
            return [r.result(timeout=300) for r in self._results]
        finally:
            self._pool.shutdown()
            self._client.close()


def _finished_requests(metrics_port: int) -> float:
    """minedraft:request_success_total of one group's scheduler, all finish reasons."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("minedraft:request_success_total"))


def test_output_equals_offline_and_load_lands_on_both_groups(stack, cases) -> None:
    before = [_finished_requests(g.metrics_port) for g in stack.groups]
    assert Load(stack.address, cases).results() == [expected for _, _, expected in cases]
    served = [_finished_requests(g.metrics_port) - b for g, b in zip(stack.groups, before, strict=True)]
    assert sum(served) == NUM_STREAMS
    assert min(served) >= NUM_STREAMS // 4, f"requests per group: {served}"


def test_bad_input_is_refused_at_the_gateway(stack) -> None:
    with Client(stack.address, timeout=30, retries=0) as client:
        for kwargs in ({"temperature": -1.0}, {"top_k": 0}):
            with pytest.raises(grpc.RpcError) as info:
                client.generate([1, 2, 3], max_tokens=4, **kwargs)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            client.generate("", max_tokens=4)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in info.value.details()
        # an error of the group (the prompt does not fit its max_model_len) passes through unchanged
        with pytest.raises(grpc.RpcError) as info:
            client.generate(list(range(1, 200)), max_tokens=4)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in info.value.details()
        assert client.server_info().max_model_len == 128  # forwarded from a group


def test_logprobs_and_prompt_logprobs_pass_through_the_gateway(pair, stack) -> None:
    prompt = _prompts()[4]  # 5 tokens
    engine = LLMEngine.local(_config(pair, speculative=False))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    expected = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    with Client(stack.address, timeout=120, retries=0) as client:
        got = client.generate(prompt, max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    assert got.token_ids == expected.output_ids
    assert [(t.logprob, list(t.top_ids)) for t in got.logprobs] == [(t.logprob, t.top_ids) for t in expected.logprobs]
    assert [(t.logprob, list(t.top_ids), t.rank) for t in got.prompt_logprobs] == [
        (t.logprob, t.top_ids, t.rank) for t in expected.prompt_logprobs]  # fmt: skip
    assert len(got.prompt_logprobs) == len(prompt) - 1


def test_sdk_retry_carries_requests_over_a_gateway_restart(stack, cases) -> None:
    stack.gateway.kill()
    stack.gateway.wait()
    restart = threading.Timer(1.0, stack.start_gateway)
    restart.start()
    retries = RetryPolicy(max_attempts=30, initial_backoff=0.1, max_backoff=1.0)
    results = Load(stack.address, cases[:8], retries=retries).results()
    restart.join()
    assert results == [expected for _, _, expected in cases[:8]]


def test_two_gateways_side_by_side(stack, cases) -> None:
    """A second replica in front of the same groups: both serve, and both balance over both groups. Its
    requests carry no deadline and last longer than its placement timeout, which bounds placement only."""
    port = free_port()
    second = subprocess.Popen(stack.gateway_command(port=port, settings=GatewaySettings(placement_timeout=0.2)))
    try:
        with Client(f"127.0.0.1:{port}", timeout=120, retries=RetryPolicy(max_attempts=60, max_backoff=0.5)) as c:
            assert c.server_info().max_model_len == 128  # up (the SDK retries until it listens)
        before = [_finished_requests(g.metrics_port) for g in stack.groups]
        loads = [Load(stack.address, cases[::2]), Load(f"127.0.0.1:{port}", cases[1::2], timeout=None)]
        assert [load.results() for load in loads] == [[e for _, _, e in cases[::2]], [e for _, _, e in cases[1::2]]]
        served = [_finished_requests(g.metrics_port) - b for g, b in zip(stack.groups, before, strict=True)]
        assert sum(served) == NUM_STREAMS and min(served) >= NUM_STREAMS // 4, f"requests per group: {served}"
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=30)


def test_a_request_that_cannot_be_placed_fails_with_unavailable(pair) -> None:
    """A gateway whose only group never serves: UNAVAILABLE before the client's deadline, saying why."""
    port = free_port()
    gateway = subprocess.Popen([
        sys.executable, "-m", "minedraft", "gateway", "--tokenizer", pair[0], "--host", "127.0.0.1",
        "--port", str(port), "--backend", f"127.0.0.1:{free_port()}",
    ])  # fmt: skip
    try:
        with Client(f"127.0.0.1:{port}", timeout=4, retries=0) as client:
            deadline = time.monotonic() + 60
            while True:  # until the gateway listens: then the request waits for a group, in vain
                with pytest.raises(grpc.RpcError) as info:
                    client.generate([1, 2, 3], max_tokens=4)
                if "not placed" in info.value.details() or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "no engine group is serving" in info.value.details()
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=30)


def test_overload_spills_to_the_other_group_then_is_resource_exhausted(pair, tmp_path) -> None:
    """Groups of 2 running + 4 waiting requests each: a burst of 40 fills both groups (more than one group
    holds), the rest are turned away with RESOURCE_EXHAUSTED, none with another code."""
    config = EngineConfig(model=pair[0], max_num_seqs=2, max_model_len=128, device="cpu")
    with GatewayStack(config, 2, scheduler=scheduler_settings(max_waiting_requests=4), log_dir=tmp_path) as small:
        codes = overload_codes(small.address)
    assert set(codes) == {"ok", "RESOURCE_EXHAUSTED"}
    assert codes.count("ok") > 2 + 4, codes


def test_a_whole_group_sigkilled_mid_stream_loses_no_request(stack, cases) -> None:
    """Last: it leaves one group. 32 streams, group 0 SIGKILLed (scheduler, verifier, drafter) mid-stream:
    its requests continue on group 1 and every stream equals the offline output."""
    before = _finished_requests(stack.groups[1].metrics_port)
    load = Load(stack.address, cases)
    load.wait_for_tokens(NUM_STREAMS * 5)  # early: the client reads behind the groups, which finish in ~1 s
    stack.kill_group(0)
    assert load.results() == [expected for _, _, expected in cases]
    # group 1 finished its own share and the migrated ones (more than half of all)
    assert _finished_requests(stack.groups[1].metrics_port) - before > NUM_STREAMS // 2


def test_up_with_two_engine_groups_serves_through_a_gateway_and_stops_everything(pair, tmp_path) -> None:
    """The public flags (--http-port, --api-key) land on the gateway."""
    port, http_port = free_port(), free_port()
    errors = open(tmp_path / "up.log", "w")  # noqa: SIM115 (the services' logs, shown if start-up fails)
    up = subprocess.Popen(
        [sys.executable, "-m", "minedraft", "up", "--engine-groups", "2", "--model", pair[0], "--port", str(port),
         "--metrics-port", "0", "--speculative-config", json.dumps({"num_speculative_tokens": 3, "is_parallel": True,
         "model": pair[1]}), "--device", "cpu", "--http-port", str(http_port), "--api-key", "up-key"],
        stdout=subprocess.PIPE, stderr=errors, text=True,
    )  # fmt: skip
    try:
        line = up.stdout.readline()
        assert "2 engine groups behind a gateway) is serving on 127.0.0.1:" in line, (
            f"{line!r}\n{(tmp_path / 'up.log').read_text()[-3000:]}"
        )
        assert up.stdout.readline().strip() == f"OpenAI-compatible API: http://127.0.0.1:{http_port}/v1"
        services = children(up.pid)
        assert len(services) == 5  # two groups of verifier (drafting too, on CPU) and scheduler; the gateway
        with Client(f"127.0.0.1:{port}", timeout=60, token="up-key") as client:
            assert client.generate([1, 2, 3], max_tokens=8, temperature=0, ignore_eos=True).usage.completion_tokens == 8
        http = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="up-key", max_retries=0)
        reply = http.completions.create(model="target", prompt=[1, 2, 3], max_tokens=4, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            http.with_options(api_key="other").models.list()
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=90) == 0
        assert [pid for pid in services if Path(f"/proc/{pid}").exists()] == [], "services outlived minedraft up"
    finally:
        if up.poll() is None:
            up.kill()
        errors.close()
