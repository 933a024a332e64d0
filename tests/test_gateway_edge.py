"""The gateway as the public edge: two engine groups behind `minedraft gateway`, as real local processes,
with API keys and TLS on every hop, driven over gRPC and over the OpenAI HTTP API with the official SDK.

The gateway checks the clients' keys itself and reaches the groups with a key of its own (the groups
refuse a client's key). Greedy output equals the offline autoregressive output text for text, streamed or
not, also when a whole group is SIGKILLed while HTTP streams run on it (they migrate to the other group).
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minedraft.client import Client, MineDraftError
from minedraft.engine.engine import LLMEngine
from minedraft.metrics import scrape
from minedraft.sampling.params import SamplingParams
from minedraft.settings import GatewaySettings
from minedraft.stack.gateway import GatewayStack
from minedraft.stack.local import free_port, scheduler_settings

from conftest import tiny_config
from services import wait_health
from tls_certs import write_self_signed_cert

KEY = "client-key"
MODEL = "target"  # the tiny target's folder name: the default served model name
MAX_TOKENS = 60
PROMPTS = [[(7 * i + j) % 300 + 1 for j in range(2 + i % 4)] for i in range(8)]
MAX_PROMPT_BYTES = 4096
TEXT_PROMPT = "def read(path):"  # tokenized at the gateway, as a scheduler would


PAIR_SEED = 3  # conftest's `pair` from this seed


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[Path, Path]:
    return write_self_signed_cert(tmp_path_factory.mktemp("tls"))


def _offline_texts(pair, prompts: list[list[int] | str], max_tokens: int) -> list[str]:
    """Offline greedy text of the target (EOS ignored) for each prompt (a str is tokenized first)."""
    engine = LLMEngine.local(tiny_config(pair, max_model_len=512))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    requests = [engine.add_request(p, params) for p in ids]
    while engine.has_unfinished():
        engine.step()
    return [r.text for r in requests]


@pytest.fixture(scope="module")
def offline(pair) -> list[str]:
    """Offline greedy text of the target (EOS ignored) for each prompt, and last for TEXT_PROMPT."""
    return _offline_texts(pair, [*PROMPTS, TEXT_PROMPT], MAX_TOKENS)


@pytest.fixture(scope="module")
def expected(offline) -> list[str]:
    return offline[: len(PROMPTS)]


@pytest.fixture(scope="module")
def stack(pair, tls, tmp_path_factory):
    """Groups serving TLS and taking only the gateway's key; the gateway serving TLS on gRPC and HTTP."""
    key, cert = str(tls[0]), str(tls[1])
    scheduler = scheduler_settings(tls_cert=cert, tls_key=key)
    gateway = GatewaySettings(http_port=free_port(), tls_cert=cert, tls_key=key, backend_tls_ca=cert,
                              max_prompt_bytes=MAX_PROMPT_BYTES)  # fmt: skip
    with GatewayStack(
        tiny_config(pair, max_num_seqs=8, max_model_len=512), 2, scheduler=scheduler, gateway=gateway, api_keys=[KEY],
        metrics_ports=[free_port(), free_port()], log_dir=tmp_path_factory.mktemp("edge-logs"),
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def client(stack, tls) -> openai.OpenAI:
    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(tls[1])))
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0, http_client=http, timeout=120)


def _complete(client: openai.OpenAI, prompt: str | list[int], stream: bool) -> str:
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(chunk.choices[0].text for chunk in client.completions.create(**kwargs, stream=True) if chunk.choices)


def test_grpc_needs_a_client_key_and_the_groups_take_only_the_gateways(stack, tls, expected) -> None:
    cert = tls[1]
    with Client(stack.address, tls=cert, token=KEY, retries=0, timeout=120) as grpc_client:
        texts = [grpc_client.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).text for p in PROMPTS]
        assert texts == expected
        assert grpc_client.server_info().max_model_len == 512
        with pytest.raises(MineDraftError) as info:  # the scheduler's limit, checked before tokenizing
            grpc_client.generate("x" * (MAX_PROMPT_BYTES + 1), max_tokens=2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-prompt-bytes" in info.value.details()
    for token in (None, "wrong"):
        with Client(stack.address, tls=cert, token=token, retries=0, timeout=60) as grpc_client:
            with pytest.raises(MineDraftError) as info:
                grpc_client.generate([1, 2], max_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert grpc_client.health()  # health checks stay open
    with Client(stack.groups[0].address, tls=cert, token=KEY, retries=0, timeout=60) as direct:
        with pytest.raises(MineDraftError) as info:
            direct.generate([1, 2], max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # a client's key is not the gateway's


def test_openai_sdk_completions_equal_offline_streamed_or_not(client, expected, offline) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert (models[0].max_model_len, models[0].decoding["mode"]) == (512, "ar")  # the groups' engine
    for stream in (False, True):
        assert [_complete(client, p, stream) for p in PROMPTS[:4]] == expected[:4]
        assert _complete(client, TEXT_PROMPT, stream) == offline[-1]
    usage = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0).usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPTS[0]), 5)


def test_the_groups_count_prompt_tokens_and_request_phases_under_vllms_names(stack, client) -> None:
    """vLLM's series are ours renamed (one count): prompt tokens, each phase once per request, output gaps."""
    urls = [f"http://127.0.0.1:{group.metrics_port}/metrics" for group in stack.groups]
    names = ["prompt_tokens_total", "request_queue_time_seconds_count", "request_prefill_time_seconds_count",
             "request_decode_time_seconds_count", "request_inference_time_seconds_count",
             "inter_token_latency_seconds_count", "num_preemptions_total"]  # fmt: skip

    def totals() -> dict[str, float]:
        samples = [scrape(url) for url in urls]
        return {name: sum(s.get(f"vllm:{name}", 0.0) for s in samples) for name in names}

    before = totals()
    for prompt in PROMPTS:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    served = {name: value - before[name] for name, value in totals().items()}
    assert served["prompt_tokens_total"] == sum(len(p) for p in PROMPTS)
    for phase in ("queue", "prefill", "decode", "inference"):
        assert served[f"request_{phase}_time_seconds_count"] == len(PROMPTS)
    assert served["inter_token_latency_seconds_count"] == len(PROMPTS) * 5  # ar: one output per token
    assert served["num_preemptions_total"] == 0
    samples = scrape(urls[0])
    assert samples["vllm:kv_cache_usage_perc"] == samples["minedraft:kv_cache_usage_perc"]
    assert samples["vllm:prompt_tokens_total"] == samples["minedraft:prompt_tokens_total"]


def test_http_errors_keys_and_open_endpoints(stack, tls, client) -> None:
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong").models.list()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=10_000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=[1, 2], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="--max-prompt-bytes"):
        client.completions.create(model=MODEL, prompt="x" * (MAX_PROMPT_BYTES + 1), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="no chat template"):  # the tiny tokenizer has none
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    context = ssl.create_default_context(cafile=str(tls[1]))
    with urllib.request.urlopen(stack.http_url + "/health", context=context, timeout=30) as reply:
        assert reply.status == 200  # no key needed


def test_a_cancelled_http_stream_leaves_its_group_idle(stack, client) -> None:
    """The client goes away mid-stream: the gateway cancels the group's stream, which frees the request there;
    the group's gauges come back to zero and the request is not counted as finished."""
    urls = [f"http://127.0.0.1:{group.metrics_port}/metrics" for group in stack.groups]
    finished = sum(scrape(url).get("minedraft:request_success_total", 0.0) for url in urls)
    stream = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=500, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while any(_load(url) for url in urls):
        assert time.monotonic() < deadline, f"gauges stuck: {[_load(url) for url in urls]}"
        time.sleep(0.2)
    assert sum(scrape(url).get("minedraft:request_success_total", 0.0) for url in urls) == finished


def _load(url: str) -> list[float]:
    """The group's running and waiting requests and its KV usage, where any is above zero."""
    samples = scrape(url)
    names = ("minedraft:num_requests_running", "minedraft:num_requests_waiting", "minedraft:kv_cache_usage_perc")
    return [samples[name] for name in names if samples[name]]


def test_a_gateway_without_a_serving_group_is_not_ready(pair, tmp_path) -> None:
    """Ready means a request could be served: no group serves, so gRPC health is NOT_SERVING and the HTTP
    /health and /v1/models answer 503 (tools poll them to know when to start)."""
    port, http_port = free_port(), free_port()
    with open(tmp_path / "gateway.log", "w") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "minedraft", "gateway", "--tokenizer", pair[0], "--host", "127.0.0.1",
             "--port", str(port), "--http-port", str(http_port), "--backend", f"127.0.0.1:{free_port()}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_health(f"127.0.0.1:{port}", "NOT_SERVING")
            for path in ("/health", "/v1/models"):
                status, _ = _get(f"http://127.0.0.1:{http_port}{path}")
                assert status == 503, path
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)


def _get(url: str) -> tuple[int, bytes]:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except urllib.error.URLError:  # not listening yet
            assert time.monotonic() < deadline, f"nothing answers at {url}"
            time.sleep(0.2)


# Long enough that group 0 is still streaming when it is killed, however late a loaded machine reads its count.
KILLED_TOKENS = 400


def test_http_streams_continue_when_their_group_is_sigkilled(stack, client, pair, tls) -> None:
    """Last: it leaves one group. Every prompt streams over HTTP; group 0 dies mid-stream; every text still
    equals the offline one."""
    expected = _offline_texts(pair, PROMPTS, KILLED_TOKENS)

    def one(prompt: list[int]) -> str:
        text = ""
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=KILLED_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    before = [_finished(group.metrics_port) for group in stack.groups]
    generated = _generated(stack.groups[0].metrics_port)
    resubmitted_before = _gateway_metrics(stack, tls)["minedraft:gateway_resubmissions_total"]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = [pool.submit(one, p) for p in PROMPTS]
        deadline = time.monotonic() + 120
        # Killed once group 0 has made a few tokens, by its own count: the client reads behind the groups, and a
        # kill timed by the chunks it had read could land after a fast group 0 had finished every stream.
        while _generated(stack.groups[0].metrics_port) < generated + 8:
            assert time.monotonic() < deadline, "group 0 never streamed"
            time.sleep(0.01)
        stack.kill_group(0)
        assert [r.result(timeout=240) for r in results] == expected
    # Every stream the gateway moved off group 0 finished on group 1, beside group 1's own. (How many group 0 had
    # finished when it died cannot be read afterwards: a fast group finishes streams while the client reads
    # behind it, and a count read just before the kill missed three that ended in between.)
    gateway = _gateway_metrics(stack, tls)
    resubmitted = gateway["minedraft:gateway_resubmissions_total"] - resubmitted_before
    assert 1 <= resubmitted <= _finished(stack.groups[1].metrics_port) - before[1] <= len(PROMPTS)
    assert gateway["minedraft:gateway_requests_in_flight"] == 0
    deadline = time.monotonic() + 30
    while _gateway_metrics(stack, tls)["minedraft:gateway_serving_groups"] != 1:  # group 0 seen gone
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _gateway_metrics(stack, tls) -> dict[str, float]:
    """The gateway's own /metrics (on its HTTPS API, open without a key), summed over label sets."""
    context = ssl.create_default_context(cafile=str(tls[1]))
    with urllib.request.urlopen(stack.http_url + "/metrics", context=context, timeout=30) as reply:
        text = reply.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def _finished(metrics_port: int) -> float:
    return scrape(f"http://127.0.0.1:{metrics_port}/metrics").get("minedraft:request_success_total", 0.0)


def _generated(metrics_port: int) -> float:
    return scrape(f"http://127.0.0.1:{metrics_port}/metrics").get("minedraft:generation_tokens_total", 0.0)
