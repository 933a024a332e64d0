"""Drafting without a model and Predicted Outputs, served: real processes, the SDK and the openai SDK.

- method ngram and suffix as a drafter service of their own (no model, no KV pool) and inside the verifier's
  process: greedy output over gRPC equals offline plain decoding, and drafts were made;
- the drafter SIGKILLed mid-stream: the group decodes target-only, the verifier drafting from the predictions
  itself, and the text is unchanged;
- Predicted Outputs through the OpenAI API with no speculative config: chat and completions, streamed and not,
  usage's accepted and rejected prediction tokens; a bad prediction is a 400 naming the field and harms no
  other request;
- a gateway migration (a whole group SIGKILLed) with predictions: every stream equals the offline output and
  its usage still counts the prediction over the whole output.

Strict kernels throughout. The tiny tokenizer's tokens other than ASCII bytes are biased away where a prediction
is sent: a prediction is text, and their text does not tokenize back to them.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.engine.engine import LLMEngine
from minedraft.model.tokenizer import load_tokenizer
from minedraft.sampling.params import SamplingParams
from minedraft.settings import WorkerSettings
from minedraft.stack.gateway import GatewayStack
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

from conftest import make_pair
from services import TWO_PROCESSES, worker_info

MAX_TOKENS = 48
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 4,
         "adaptive": False}  # fmt: skip
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "is_parallel": True, "adaptive": False}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_pair(tmp_path_factory.mktemp("lookup-serving"), seed=3)
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # chat needs a template: a plain one
    (Path(target) / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return target, draft


def _config(pair, spec: dict | None, **overrides) -> EngineConfig:
    fields = {"max_num_seqs": 4, "max_model_len": 160, "device": "cpu", "batch_invariant": True, **overrides}
    return EngineConfig(model=pair[0], speculative_config=spec, **fields)


@pytest.fixture(scope="module")
def ascii_bias(pair) -> dict[int, float]:
    tokenizer = load_tokenizer(pair[0])
    keep = {i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).isascii()
            and tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i]}  # fmt: skip
    return {i: -100.0 for i in range(tokenizer.vocab_size) if i not in keep}


def _prompts() -> list[list[int]]:
    """Prompts that repeat a phrase (the lookups find it) and prompts that do not."""
    return [[40 + i, 41, 42 + i] * (1 + i % 4) + [40 + i] for i in range(8)]


def _offline(pair, prompts: list[list[int]], bias: dict[int, float] | None = None) -> list[tuple[list[int], str]]:
    engine = LLMEngine.local(_config(pair, None))
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=bias or {})
        requests = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [(r.output_ids, r.text) for r in requests]
    finally:
        engine.executor.close()


def _edited(text: str) -> str:
    """A prediction right in part: a word changed a third of the way in, a piece dropped later."""
    a, b = len(text) // 3, 2 * len(text) // 3
    return text[:a] + "#" + text[a + 1 : b] + text[b + 3 :]


def _generate(address: str, prompts: list[list[int]], **options) -> list:
    with Client(address, timeout=120) as client, ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                         **options), prompts))  # fmt: skip


def _stream_and_strike(client: Client, prompts: list[list[int]], predictions: list[str], bias: dict[int, float],
                       after_tokens: int, strike) -> list[tuple[list[int], object]]:  # fmt: skip
    """Stream every prompt with its prediction at once, read slowly, and `strike()` once `after_tokens` tokens came:
    each stream's token ids and its last usage."""
    received, lock = [0], threading.Lock()

    def one(i: int) -> tuple[list[int], object]:
        ids, usage = [], None
        for delta in client.stream(prompts[i], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                   logit_bias=bias, prediction=predictions[i]):  # fmt: skip
            ids += delta.token_ids
            with lock:
                received[0] += len(delta.token_ids)
            time.sleep(0.02)  # read slowly: the strike lands mid-stream
            usage = delta.usage or usage
        return ids, usage

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = [pool.submit(one, i) for i in range(len(prompts))]
        deadline = time.monotonic() + 60
        while received[0] < after_tokens and time.monotonic() < deadline:
            time.sleep(0.005)
        strike()
        return [r.result(timeout=240) for r in results]


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["sd+ngram", "minedraft+suffix"])
@pytest.mark.parametrize("worker", [TWO_PROCESSES, WorkerSettings(colocate_drafter=True)],
                         ids=["drafter-service", "in-the-verifier"])  # fmt: skip
def test_lookup_methods_over_grpc_equal_offline_ar(pair, spec, worker) -> None:
    prompts = _prompts()
    expected = [ids for ids, _ in _offline(pair, prompts)]
    with LocalStack(_config(pair, spec), worker=worker) as stack:
        if stack.drafter_address:  # a drafter without a model: no KV pool, nothing loaded
            info = worker_info(stack.drafter_address)
            assert (info.role, info.num_blocks, info.vocab_size) == ("drafter", 0, 0)
        else:
            assert worker_info(stack.verifier_address).drafts
        got = _generate(stack.address, prompts)
    assert [c.token_ids for c in got] == expected
    assert sum(c.spec_decode_stats.num_accepted_tokens for c in got) > 0


def test_a_lookup_drafter_is_colocated_by_default() -> None:
    from minedraft.stack.local import colocates_by_default

    assert colocates_by_default(EngineConfig(speculative_config={"method": "ngram"}, device="cpu"))
    assert not colocates_by_default(EngineConfig(speculative_config={"method": "ngram"}, device="cpu",
                                                 tensor_parallel_size=2))  # fmt: skip


def test_a_sigkilled_lookup_drafter_costs_no_request_and_predictions_still_draft(pair, ascii_bias) -> None:
    prompts = _prompts()[:4]
    expected = _offline(pair, prompts, ascii_bias)
    # A gloo send to the killed drafter may wait out the world's timeout instead of failing (when its connection was
    # not made yet): a short one, as for a hung peer, keeps that wait within the client's.
    workers = TWO_PROCESSES.model_copy(update={"dist_timeout": 15.0})
    with LocalStack(_config(pair, NGRAM), worker=workers) as stack, Client(stack.address, timeout=120) as client:
        predictions = [_edited(text) for _, text in expected]
        outputs = _stream_and_strike(client, prompts, predictions, ascii_bias, 8,
                                     lambda: stack.process("drafter").send_signal(signal.SIGKILL))  # fmt: skip
        assert [ids for ids, _ in outputs] == [ids for ids, _ in expected]
        assert all(usage.accepted_prediction_tokens > 0 for _, usage in outputs)
        # Target-only now: the verifier drafts from a prediction itself.
        after = client.generate(prompts[0], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                logit_bias=ascii_bias, prediction=expected[0][1])  # fmt: skip
        assert after.token_ids == expected[0][0]
        assert after.spec_decode_stats.num_accepted_tokens > MAX_TOKENS // 2
        assert after.usage.accepted_prediction_tokens == MAX_TOKENS


@pytest.fixture(scope="module")
def http_stack(pair, tmp_path_factory):
    """No speculative config: the verifier drafts from predictions itself."""
    settings = scheduler_settings(http_port=free_port())
    config = _config(pair, None, max_prediction_tokens=100)
    with LocalStack(config, scheduler=settings, log_dir=tmp_path_factory.mktemp("logs")) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(http_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http_stack.http_url}/v1", api_key="none", max_retries=0)


def test_completions_with_a_prediction_equal_ar_and_count_it(pair, ascii_bias, client) -> None:
    prompt = _prompts()[5]
    (ids, text), = _offline(pair, [prompt], ascii_bias)
    bias = {str(t): b for t, b in ascii_bias.items()}
    for prediction in (text, _edited(text), [{"type": "text", "text": text[:20]}, {"type": "text", "text": text[20:]}]):
        reply = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS,
                                          temperature=0, logit_bias=bias,
                                          extra_body={"ignore_eos": True,
                                                      "prediction": {"type": "content", "content": prediction}})
        assert reply.choices[0].text == text
        details = reply.usage.completion_tokens_details
        whole = isinstance(prediction, list) or prediction == text
        assert details.accepted_prediction_tokens == (MAX_TOKENS if whole else details.accepted_prediction_tokens)
        assert 0 < details.accepted_prediction_tokens <= MAX_TOKENS
        assert details.rejected_prediction_tokens == len(load_tokenizer(pair[0]).encode(
            prediction if isinstance(prediction, str) else text, add_special_tokens=False)) - (
            details.accepted_prediction_tokens)  # fmt: skip


def test_chat_with_a_prediction_streams_usage(pair, ascii_bias, client) -> None:
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Say it again."}]
    bias = {str(t): b for t, b in ascii_bias.items()}
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           logit_bias=bias)  # fmt: skip
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # no prediction, no prediction counts
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logit_bias=bias, stream=True,
        stream_options={"include_usage": True}, prediction={"type": "content", "content": text}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage
    assert usage.completion_tokens_details.accepted_prediction_tokens == usage.completion_tokens
    assert usage.completion_tokens_details.rejected_prediction_tokens == 0


def _post(stack, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{stack.http_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(
    ("prediction", "message"),
    [
        ({"type": "text", "content": "x"}, "prediction.type"),
        ({"type": "content", "content": 5}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image_url", "image_url": "u"}]}, "prediction.content"),
        ("just text", "prediction"),
        ({"type": "content", "content": "w" * 120}, "prediction: 120 tokens is more than this server takes (100, its "
                                                   "max_prediction_tokens)"),
    ],
    ids=["wrong-type", "not-text", "not-a-text-part", "not-an-object", "too-long"],
)
def test_a_bad_prediction_is_a_400_naming_it_and_harms_no_other_request(http_stack, client, prediction,
                                                                        message) -> None:  # fmt: skip
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(2) as pool:
        other = pool.submit(client.completions.create, model=model, prompt="hello", max_tokens=MAX_TOKENS,
                            temperature=0)  # fmt: skip
        for path, body in (("/v1/completions", {"prompt": "hello"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            status, reply = _post(http_stack, path, {"model": model, "max_tokens": 8, **body, "prediction": prediction})
            assert status == 400, reply
            assert message in reply["error"]["message"] or reply["error"]["param"] == message, reply
        assert other.result(timeout=120).usage.completion_tokens == MAX_TOKENS


def test_a_migrated_stream_keeps_its_prediction(pair, ascii_bias, tmp_path) -> None:
    """Two groups behind the gateway, group 0 SIGKILLed mid-stream: the streams it ran resume on group 1 with their
    predictions, every output equals the offline one, and usage counts the prediction over the whole output."""
    prompts = [[60 + i, 61, 62] * 2 for i in range(8)]
    expected = _offline(pair, prompts, ascii_bias)
    config = _config(pair, NGRAM, max_num_seqs=8)
    with GatewayStack(config, 2, log_dir=tmp_path) as stack, Client(stack.address, timeout=180) as client:
        outputs = _stream_and_strike(client, prompts, [text for _, text in expected], ascii_bias, 16,
                                     lambda: stack.kill_group(0))  # fmt: skip
    assert [ids for ids, _ in outputs] == [ids for ids, _ in expected]
    assert all(usage.accepted_prediction_tokens == MAX_TOKENS for _, usage in outputs)
