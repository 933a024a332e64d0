"""LoRA adapters served as vLLM serves them, over one real group (scheduler, verifier, drafter) and a gateway
in front of it: the OpenAI `model` field and gRPC's `lora_adapter` pick the adapter, greedy output equals the
offline engine with that adapter, /v1/models lists it under its base, and /metrics has vLLM's LoRA series.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from prometheus_client import generate_latest

from minedraft.client import Client, MineDraftError
from minedraft.gateway.policies import PrefixAffinity
from minedraft.gateway.router import Migration
from minedraft.llm import LLM, LoRARequest
from minedraft.metrics import Metrics
from minedraft.sampling.params import SamplingParams
from minedraft.settings import GatewaySettings
from minedraft.stack.gateway import GatewayStack
from minedraft.stack.local import free_port, scheduler_settings

from conftest import tiny_config

PROMPT = "def main():"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def config(pair):
    from test_lora import make_adapter

    folder = Path(pair[0]).parent / "lora-a"  # the same adapter test_services_e2e makes, made once
    adapter = folder if folder.exists() else make_adapter(Path(pair[0]), folder, seed=1)
    return tiny_config(pair, {"num_speculative_tokens": 3, "is_parallel": True}, enable_lora=True,
                       lora_modules=[{"name": "a", "path": str(adapter)}])  # fmt: skip


@pytest.fixture(scope="module")
def expected(config) -> dict[str | None, tuple[list[int], str]]:
    """Offline greedy (token ids, text) of PROMPT through adapter "a" and through the base model."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    fields = config.model_dump(exclude_unset=True)
    with LLM(**fields) as llm:
        outputs = {lora: llm.generate(PROMPT, params, lora_request=lora and LoRARequest(lora, 1))[0].outputs[0]
                   for lora in ("a", None)}  # fmt: skip
    found = {lora: (list(out.token_ids), out.text) for lora, out in outputs.items()}
    assert found["a"] != found[None], "the adapter must change the output, or the tests prove nothing"
    return found


@pytest.fixture(scope="module")
def stack(config, tmp_path_factory):
    scheduler = scheduler_settings(http_port=free_port(), metrics_port=free_port())
    with GatewayStack(config, 1, scheduler=scheduler, gateway=GatewaySettings(http_port=free_port()),
                      log_dir=tmp_path_factory.mktemp("lora-logs")) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module", params=["scheduler", "gateway"])
def front(request, stack) -> tuple[str, str]:
    """(gRPC address, HTTP URL) of the group's scheduler, then of the gateway before it."""
    if request.param == "scheduler":
        return stack.groups[0].address, stack.groups[0].http_url
    _wait_models(stack.http_url)
    return stack.address, stack.http_url


def _wait_models(url: str) -> None:
    """The gateway's HTTP API serves once it has read a group's server info (the adapters among it)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=20, timeout=10)
    client.models.list()


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("model", ["a", None])
def test_greedy_output_through_the_adapter_equals_offline(front, stack, expected, model) -> None:
    """OpenAI's `model` (the adapter's name or the base's) and the client SDK's `lora` pick the same weights
    as the offline engine's lora_request."""
    served = model or stack.settings.served_model_name
    completion = _openai(front[1]).completions.create(model=served, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert (completion.model, completion.choices[0].text) == (served, expected[model][1])
    with Client(front[0]) as client:
        reply = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora=model)
    assert reply.token_ids == expected[model][0]


def test_unknown_adapter_is_refused_by_name(front) -> None:
    with pytest.raises(openai.NotFoundError) as http_error:
        _openai(front[1]).completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert http_error.value.code == "model_not_found" and "nope" in http_error.value.message
    with Client(front[0]) as client, pytest.raises(MineDraftError) as grpc_error:
        client.generate(PROMPT, max_tokens=2, lora="nope")
    assert grpc_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'nope'" in grpc_error.value.details()


def test_models_list_the_adapter_under_its_base(front, stack) -> None:
    base = stack.settings.served_model_name
    cards = {m.id: m for m in _openai(front[1]).models.list().data}
    assert set(cards) == {base, "a"}
    assert cards["a"].parent == base and cards[base].parent is None
    assert _openai(front[1]).models.retrieve("a").parent == base
    with Client(front[0]) as client:
        assert client.server_info().lora_adapters == ("a",)


def test_lora_requests_info_on_metrics(stack, front) -> None:
    _openai(front[1]).completions.create(model="a", prompt=PROMPT, max_tokens=2)
    port = stack.groups[0].metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    line = next(s for s in text.splitlines() if s.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="1"' in line and 'running_lora_adapters=' in line and 'waiting_lora_adapters=' in line
    assert float(line.rsplit(" ", 1)[1]) > 1e9  # the time of the last update


def test_lora_requests_info_holds_one_series_of_the_adapters_in_use() -> None:
    """Comma-joined names in vLLM's labels; each update replaces the series (no pile of stale combinations)."""
    metrics = Metrics(model_name="m")
    metrics.record_lora(["a"], ["b", "c"], 2)
    metrics.record_lora(["a", "b"], [], 2)
    lines = [s for s in generate_latest(metrics.registry).decode().splitlines()
             if s.startswith("vllm:lora_requests_info{")]  # fmt: skip
    assert len(lines) == 1, lines
    assert 'running_lora_adapters="a,b"' in lines[0] and 'waiting_lora_adapters=""' in lines[0]
    assert 'max_lora="2"' in lines[0]


def test_a_migrated_request_keeps_its_adapter(config) -> None:
    """The gateway's resubmission of a request (after its group failed) runs through the same adapter."""
    from minedraft.model.tokenizer import load_tokenizer

    params = SamplingParams(temperature=0, max_tokens=4)
    migration = Migration("r", [1, 2, 3], params, load_tokenizer(config.target_path), lora="a")
    assert migration.submission().lora_adapter == "a"


def test_prefix_routing_keeps_each_adapters_cache_apart() -> None:
    """The prefix policy keys blocks as the groups do (`chain_keys`, full blocks below the last token): a prompt
    under an adapter shares no cached block with the same prompt under the base model or another adapter."""
    policy = PrefixAffinity()
    policy.block_size = 4
    keys = {lora: policy.placement(list(range(12)), 8, None, lora).keys for lora in (None, "a", "b")}
    assert len(keys[None]) == 2 and not set(keys[None]) & set(keys["a"]) and not set(keys["a"]) & set(keys["b"])


def test_runtime_loading_is_refused_where_not_enabled(front) -> None:
    """Without allow_runtime_lora_updating the routes answer 404 (as vLLM's, where they are off), naming the
    flags that turn them on; the gateway passes the groups' answer on."""
    from services import post_json

    for path, body in (("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "b"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a"})):  # fmt: skip
        status, data = post_json(front[1] + path, json.dumps(body).encode())
        assert status == 404 and "--allow-runtime-lora-updating" in json.loads(data)["error"]["message"], data
