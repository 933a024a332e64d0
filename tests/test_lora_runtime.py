"""LoRA adapters loaded and unloaded while serving (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter).

In one process first (the engine and its workers): a loaded adapter gives the greedy output of its PEFT-merged
target, and sampled output under speculation follows the merged target's distribution (chi-square, as
test_lossless_sampling); refusals name the setting or the file. Then over real processes: a stack's HTTP API
loads, serves, lists and unloads an adapter; a SIGKILLed verifier, restarted by the supervisor, gets the
adapters loaded at run time with its first world.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from pathlib import Path

import openai
import pytest
from scipy.stats import chisquare
from test_lora import make_adapter, merged_checkpoint

from minedraft.config import EngineConfig, LoraModule
from minedraft.engine.engine import LLMEngine
from minedraft.engine.loras import LoraRefused
from minedraft.sampling.params import SamplingParams
from minedraft.settings import SupervisorSettings
from minedraft.stack.local import LocalStack, free_port, scheduler_settings
from minedraft.stack.supervision import Supervisor

from conftest import make_pair, offline_greedy, tiny_config
from services import post_json, serving

PROMPTS = [[5, 17, 42], [9, 8, 7, 6, 5]]
MAX_TOKENS = 10
SPEC = {"num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny pair (its draft agrees with the target now and then), an adapter
    root holding target adapter `a`, its drafter adapter and a broken copy, and `a` merged into the target."""
    base = tmp_path_factory.mktemp("runtime-lora")
    pair = make_pair(base)
    root = base / "adapters"
    make_adapter(Path(pair[0]), root / "a", seed=1)
    make_adapter(Path(pair[1]), root / "a-draft", seed=2)
    shutil.copytree(root / "a", root / "broken")
    (root / "broken" / "adapter_model.safetensors").unlink()
    merged = merged_checkpoint(Path(pair[0]), root / "a", base / "merged-a")
    return pair, root, str(merged)


def _config(world, spec=SPEC, **fields) -> EngineConfig:
    pair, root, _ = world
    return tiny_config(pair, spec, enable_lora=True, allow_runtime_lora_updating=True, lora_root=str(root), **fields)


def _update(engine: LLMEngine, change: LoraModule | str) -> LoraRefused | None:
    """Load or unload through the engine as the scheduler's loop does; the outcome once the workers answered."""
    outcome: list[LoraRefused | None] = []
    (engine.unload_lora if isinstance(change, str) else engine.load_lora)(change, outcome.append)
    engine.flush()
    assert len(outcome) == 1
    return outcome[0]


def _greedy(engine: LLMEngine, lora: str | None) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [engine.add_request(p, params, lora=lora) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in requests]


@pytest.fixture(scope="module")
def expected(world) -> list[list[int]]:
    """The merged target's greedy output alone (plain decoding): what the adapter must give in every mode."""
    pair, _, merged = world
    return offline_greedy(tiny_config((merged, pair[1])), PROMPTS, MAX_TOKENS)


def test_loaded_adapter_equals_the_merged_target_and_unloads(world, expected) -> None:
    engine = LLMEngine.local(_config(world, {**SPEC, "is_parallel": True}))
    assert _update(engine, LoraModule(name="a", path="a", draft_path="a-draft")) is None  # relative to lora_root
    assert engine.lora_adapters == ["a"]
    assert _greedy(engine, "a") == expected
    assert _greedy(engine, None) != expected, "the adapter changes the output, or this proves nothing"
    assert _update(engine, "a") is None
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        engine.add_request(PROMPTS[0], SamplingParams(), lora="a")


def test_unload_waits_for_the_requests_running_through_it(world, expected) -> None:
    engine = LLMEngine.local(_config(world))
    assert _update(engine, LoraModule(name="a", path=str(world[1] / "a"))) is None
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    running = engine.add_request(PROMPTS[0], params, lora="a")
    engine.step()
    done: list[LoraRefused | None] = []
    engine.unload_lora("a", done.append)
    assert done == [] and engine.lora_adapters == []  # new requests are refused at once; this one runs on
    while engine.has_unfinished():
        engine.step()
        engine.settle_loras()
    assert done == [None] and running.output_ids == expected[0]


def test_refusals_name_the_setting_or_the_file(world) -> None:
    engine = LLMEngine.local(_config(world))
    with pytest.raises(LoraRefused, match="outside lora_root") as outside:
        engine.load_lora(LoraModule(name="x", path="../merged-a"), print)
    assert outside.value.kind == "invalid"
    refused = _update(engine, LoraModule(name="x", path="broken"))
    assert refused is not None and refused.kind == "invalid"
    assert "adapter_model.safetensors" in str(refused) and "\n" not in str(refused)
    assert engine.lora_adapters == [] and "x" not in engine.lora_modules  # undone
    with pytest.raises(LoraRefused, match="'zzz' is not loaded") as unknown:
        engine.unload_lora("zzz", print)
    assert unknown.value.kind == "not_found"
    off = LLMEngine.local(tiny_config(world[0], SPEC, enable_lora=True))
    with pytest.raises(LoraRefused, match="--allow-runtime-lora-updating") as disabled:
        off.load_lora(LoraModule(name="a", path="a"), print)
    assert disabled.value.kind == "off"


NUM_SAMPLES = 3000
SAMPLING = dict(temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True)


def test_sampled_output_through_a_loaded_adapter_follows_the_merged_target(world) -> None:
    """Temperature 1 under speculation (sd, the drafter with its own adapter): the joint distribution of two
    sampled tokens is the PEFT-merged target's, computed exactly (test_lossless_sampling's reference)."""
    from test_lossless_sampling import PROMPT, _exact_joint

    joint = _exact_joint(world[2], SAMPLING)
    engine = LLMEngine.local(_config(world, max_num_seqs=64, max_model_len=16, draft_support_size=64,
                                     batch_invariant=False))  # fmt: skip
    assert _update(engine, LoraModule(name="a", path="a", draft_path="a-draft")) is None
    requests = [engine.add_request(PROMPT, SamplingParams(**SAMPLING, seed=i), lora="a") for i in range(NUM_SAMPLES)]
    while engine.has_unfinished():
        engine.step()
    engine.executor.close()
    drafted = sum(r.stats.num_draft_tokens for r in requests)
    accepted = sum(r.stats.num_accepted_tokens for r in requests)
    assert 0 < accepted < drafted, (accepted, drafted)  # both sides of the rejection rule ran
    counts = Counter(tuple(r.output_ids) for r in requests)
    assert set(counts) <= set(joint), f"sampled pairs the adapted target cannot produce: {set(counts) - set(joint)}"
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * NUM_SAMPLES >= 5]  # rare cells pooled, as test_lossless_sampling does
    rare = [c for c in cells if c not in big]
    observed = [counts[c] for c in big] + ([sum(counts[c] for c in rare)] if rare else [])
    expected = [joint[c] * NUM_SAMPLES for c in big] + ([sum(joint[c] for c in rare) * NUM_SAMPLES] if rare else [])
    scale = sum(observed) / sum(expected)
    result = chisquare(observed, [e * scale for e in expected])
    assert result.pvalue > 1e-3, f"differs from the adapted target (chi2={result.statistic:.1f}, p={result.pvalue:.2g})"


# --- real processes -----------------------------------------------------------------------------------------


def _post(url: str, path: str, body: dict) -> tuple[int, str]:
    status, data = post_json(url + path, json.dumps(body).encode())
    return status, data.decode()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _completion(url: str, model: str, prompt: list[int]) -> str:
    reply = _client(url).completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    return reply.choices[0].text


@pytest.fixture(scope="module")
def stack(world, tmp_path_factory):
    config = _config(world, {**SPEC, "is_parallel": True, "adaptive": False})
    with LocalStack(config, scheduler=scheduler_settings(http_port=free_port()),
                    log_dir=tmp_path_factory.mktemp("runtime-lora-logs")) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def expected_text(world, expected) -> list[str]:
    from minedraft.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(world[0][0])
    return [tokenizer.decode(ids) for ids in expected]


def test_load_serve_list_and_unload_over_http(stack, expected_text) -> None:
    url = stack.http_url
    status, text = _post(url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "a", "draft_path": "a-draft"})
    assert (status, text) == (200, "Success: LoRA adapter 'a' added successfully.")
    assert {m.id for m in _client(url).models.list().data} == {stack.scheduler.served_model_name or "target", "a"}
    assert [_completion(url, "a", p) for p in PROMPTS] == expected_text
    status, text = _post(url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "a"})
    assert status == 400 and "already loaded" in text
    status, text = _post(url, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert (status, text) == (200, "Success: LoRA adapter 'a' removed successfully.")
    with pytest.raises(openai.NotFoundError) as gone:
        _completion(url, "a", PROMPTS[0])
    assert gone.value.code == "model_not_found"
    status, text = _post(url, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert status == 404 and json.loads(text)["error"]["type"] == "not_found_error"


def test_refused_outside_the_root_and_for_a_bad_folder(stack) -> None:
    status, text = _post(stack.http_url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"})
    error = json.loads(text)["error"]
    assert status == 400 and "outside lora_root" in error["message"] and error["param"] == "lora_path"
    status, text = _post(stack.http_url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "broken"})
    message = json.loads(text)["error"]["message"]
    assert status == 400 and "adapter_model.safetensors" in message and "\n" not in message
    assert {m.id for m in _client(stack.http_url).models.list().data} == {stack.scheduler.served_model_name or
                                                                          "target"}  # fmt: skip


def test_a_restarted_verifier_serves_the_adapters_loaded_at_run_time(stack, expected_text) -> None:
    """Last: it kills the verifier. The supervisor starts it again with its unchanged command (which names no
    adapter); the scheduler's join gives it the group's adapters, the run-time load among them."""
    url = stack.http_url
    status, _ = _post(url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "a", "draft_path": "a-draft"})
    assert status == 200
    supervisor = Supervisor(stack, SupervisorSettings(restart_backoff_max=1.0))
    stack.process("verifier").kill()
    stack.process("verifier").wait()
    deadline = time.monotonic() + 120
    while supervisor.restarts["verifier"] == 0 or not serving(stack.address):
        assert supervisor.poll() is None and time.monotonic() < deadline, "the verifier was not restarted in time"
        time.sleep(0.2)
    assert [_completion(url, "a", p) for p in PROMPTS] == expected_text
