"""Routing policies at the gateway, over two real engine groups (one stack), with a gateway process per policy.

Every policy serves the OpenAI API with the release's API key; `prefix` and `predicted` send a request whose
prompt starts with a long prefix already sent to the group that served it (its prefix cache hits prove it);
`prefix` keeps an x-session-id on one group; responses carry each request's speculative decoding counts when
asked; the schedulers' /metrics has the series the inference gateway's endpoint picker reads; and a stream
goes on when its group is SIGKILLed (last: it leaves one group).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from minedraft.gateway.policies import IMBALANCE
from minedraft.gateway.pool import LOAD_INTERVAL_S
from minedraft.metrics import PREFIX_CACHE_HITS, scrape
from minedraft.settings import GatewaySettings
from minedraft.stack.gateway import GatewayStack
from minedraft.stack.local import child_env, free_port

from conftest import make_pair, tiny_config

KEY = "route-key"
POLICIES = ("least-work", "prefix", "predicted")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Two groups; its own gateway routes by prefix and reports per-request speculation in detail."""
    pair = make_pair(tmp_path_factory.mktemp("routing"), seed=5)
    # Fixed k: the responses' drafting counts are checked, and adaptive speculation may stop drafting here.
    config = tiny_config(pair, {"num_speculative_tokens": 3, "is_parallel": True, "adaptive": False}, max_num_seqs=8)
    settings = GatewaySettings(http_port=free_port(), routing_policy="prefix",
                               per_request_spec_decode_metrics="detailed")  # fmt: skip
    with GatewayStack(config, 2, metrics_ports=[free_port(), free_port()], gateway=settings, api_keys=[KEY],
                      log_dir=tmp_path_factory.mktemp("routing-logs")) as stack:  # fmt: skip
        yield stack


@pytest.fixture(scope="module")
def clients(stack):
    """policy -> an OpenAI client of a gateway routing by it, all over the same two groups."""
    found = {"prefix": _client(stack.http_url)}
    extra = []
    try:
        for policy in ("least-work", "predicted"):
            port = free_port()
            settings = stack.settings.model_copy(update={"http_port": port, "routing_policy": policy,
                                                         "per_request_spec_decode_metrics": None})  # fmt: skip
            command = stack.gateway_command(port=free_port(), settings=settings)
            extra.append(subprocess.Popen(command, env=stack.gateway_env(child_env(dict(os.environ)))))
            found[policy] = _client(f"http://127.0.0.1:{port}")
        for client in found.values():
            _wait_models(client)
        yield found
    finally:
        for process in extra:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _wait_models(client: openai.OpenAI, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.models.list()
            return
        except (openai.APIConnectionError, openai.APIStatusError):
            assert time.monotonic() < deadline, f"{client.base_url} does not serve"
            time.sleep(0.2)


def _group_counts(stack, name: str) -> list[float]:
    return [scrape(f"http://127.0.0.1:{g.metrics_port}/metrics").get(name, 0.0) for g in stack.groups]


def _served(stack) -> list[float]:
    return _group_counts(stack, "minedraft:request_success_total")


def _complete(client: openai.OpenAI, prompt: list[int], max_tokens: int = 8, **kwargs):
    return client.completions.create(model="target", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, **kwargs)  # fmt: skip


def _delta(after: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before, strict=True)]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_serves_with_the_api_key_and_uses_both_groups(stack, clients, policy) -> None:
    client = clients[policy]
    before = _served(stack)
    prompts = [[(7 * i + j) % 300 + 1 for j in range(3)] for i in range(12)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: _complete(client, p, max_tokens=24), prompts))
    assert [r.usage.completion_tokens for r in replies] == [24] * len(prompts)
    served = _delta(_served(stack), before)
    assert sum(served) == len(prompts) and min(served) >= 1, f"requests per group: {served}"
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong").models.list()


# Not `predicted`: on these toy groups a 64-token prefix saves less prefill time than the groups' measured
# per-token speeds differ by, and `predicted` rightly weighs both (docs/services.md, "Routing policies").
@pytest.mark.parametrize("policy", ["prefix"])
def test_a_shared_long_prefix_goes_to_the_group_that_holds_it(stack, clients, policy) -> None:
    """Four 64-token prefixes, first sent together (spread over both groups), then, once the groups reported
    that they are idle again, each with another tail, one at a time: each second request finds the prefix's 4
    blocks in the cache of the group that served the first (least-work would send them all to one group)."""
    client = clients[policy]
    offset = 100 if policy == "prefix" else 200  # prefixes no earlier test sent
    prefixes = [[(offset + 13 * i + j) % 290 + 5 for j in range(64)] for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: _complete(client, [*p, 1], max_tokens=4), prefixes))
    time.sleep(LOAD_INTERVAL_S * 1.5)
    before = _group_counts(stack, PREFIX_CACHE_HITS + "_total")
    for prefix in prefixes:
        _complete(client, [*prefix, 2, 3], max_tokens=4)
    hits = _delta(_group_counts(stack, PREFIX_CACHE_HITS + "_total"), before)
    assert sum(hits) >= 4 * 64, f"prefix cache hits per group: {hits}"  # every second request hit its blocks


def test_a_session_stays_on_one_group(stack, clients) -> None:
    """Requests at once, fewer than the imbalance margin lets one group take beyond the other (least-work
    would spread them), after the groups' load reports caught up with the earlier tests."""
    time.sleep(LOAD_INTERVAL_S * 1.5)
    before = _served(stack)
    prompts = [[i + 1, i + 2, i + 3] for i in range(IMBALANCE - 1)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: _complete(clients["prefix"], p, extra_headers={"x-session-id": "alice"}), prompts))
    assert sorted(_delta(_served(stack), before)) == [0, len(prompts)]


def _check_counts(counts: dict) -> None:
    assert counts["num_drafts"] > 0 and 0 <= counts["num_accepted_tokens"] <= counts["num_draft_tokens"]
    assert sum(counts["num_accepted_tokens_per_pos"]) == counts["num_accepted_tokens"]
    assert len(counts["num_accepted_tokens_per_pos"]) <= 3  # num_speculative_tokens
    assert counts["mean_acceptance_length"] == pytest.approx(1 + counts["num_accepted_tokens"] / counts["num_drafts"])
    histogram = counts["acceptance_histogram"]  # vLLM's: verifications by how many drafts they accepted
    assert sum(histogram) == counts["num_spec_steps"] == counts["num_drafts"]
    assert sum(j * n for j, n in enumerate(histogram)) == counts["num_accepted_draft_tokens"]
    assert counts["draft_acceptance_rate"] == pytest.approx(counts["num_accepted_tokens"] / counts["num_draft_tokens"])


def test_responses_carry_the_requests_speculative_decoding_counts(clients) -> None:
    reply = _complete(clients["prefix"], [5, 6, 7], max_tokens=32)
    _check_counts(reply.model_extra["metrics"]["speculative_decoding"])
    stream = clients["prefix"].completions.create(model="target", prompt=[5, 6, 7], max_tokens=32, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    _check_counts(chunks[-1].model_extra["metrics"]["speculative_decoding"])
    assert all("metrics" not in (c.model_extra or {}) for c in chunks[:-1])
    assert "metrics" not in (_complete(clients["least-work"], [5, 6, 7]).model_extra or {})  # off by default


def test_schedulers_speak_the_inference_gateway_model_server_protocol(stack) -> None:
    """What the endpoint picker scrapes, under vLLM's names, on a live scheduler's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.groups[0].metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for series in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert f"\n# TYPE {series} gauge" in text and f"\n{series}{{" in text, series
    assert "\nvllm:cache_config_info{" in text and 'block_size="16"' in text  # optional: for prefix-aware picking


def test_streams_go_on_when_their_group_is_sigkilled(stack, clients) -> None:
    """Last: it leaves one group. Eight greedy streams through the `predicted` gateway, group 0 killed
    after their first chunks: every stream ends with the text one group alone gives."""
    client = clients["predicted"]
    prompts = [[40 + i, 41, 42] for i in range(8)]
    expected = [_complete(client, p, max_tokens=100).choices[0].text for p in prompts]
    started = ThreadPoolExecutor(8)

    def stream(prompt: list[int], ready) -> str:
        chunks = client.completions.create(model="target", prompt=prompt, max_tokens=100, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        text = ""
        for chunk in chunks:
            text += chunk.choices[0].text if chunk.choices else ""
            ready.append(1)
        return text

    ready: list[int] = []
    results = [started.submit(stream, p, ready) for p in prompts]
    deadline = time.monotonic() + 60
    while len(ready) < 8 and time.monotonic() < deadline:
        time.sleep(0.005)
    stack.kill_group(0)
    assert [r.result(timeout=120) for r in results] == expected
    started.shutdown()
    gateway_metrics = str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
    assert scrape(gateway_metrics).get("minedraft:gateway_resubmissions_total", 0) >= 1  # some did migrate
