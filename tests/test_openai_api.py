"""The OpenAI-compatible HTTP API through the official `openai` SDK, against a real local stack.

One stack for the module: the bundled pair in MineDraft mode with strict kernels, behind TLS (a
self-signed certificate made here) and an API key, on both protocols. Greedy output must equal the
offline autoregressive output of the target, streamed or not, and through the bundled chat template.
"""

from __future__ import annotations

import http.client
import json
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from minedraft.client import Client, MineDraftError
from minedraft.config import EngineConfig
from minedraft.llm import LLM
from minedraft.sampling.params import SamplingParams
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

from tiny_models import make_tiny_checkpoint
from tls_certs import write_self_signed_cert

KEY = "test-key-1"
MODEL = "minedraft-target"  # the bundled target's folder name: the default served model name
PROMPTS = ["def main():", "import os\n\n\ndef read(path):", "class Stack:\n    def __init__(self):"]
MAX_TOKENS = 24
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
# Each sampling option once (greedy): the served output must be the offline ar output with the same option.
OPTIONS = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 1.2},
    {"repetition_penalty": 1.5},
    {"logit_bias": {"328": -100, "25": 3.0}},  # 328: the first token the prompt gets greedily
    {"min_tokens": 3, "stop_token_ids": [328]},
    {"min_p": 0.2, "presence_penalty": 0.8},
    {"bad_words": ["isinstance"]},  # the greedy text holds it
]


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[Path, Path]:
    return write_self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def stack(tls, tmp_path_factory):
    key, cert = tls
    config = EngineConfig(
        speculative_config={"num_speculative_tokens": 3, "is_parallel": True},
        max_num_seqs=2, device="cpu", batch_invariant=True,
    )  # fmt: skip
    settings = scheduler_settings(http_port=free_port(), tls_cert=str(cert), tls_key=str(key))
    with LocalStack(config, scheduler=settings, api_keys=[KEY], log_dir=tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    """Offline autoregressive text of the target for each prompt and for the rendered chat."""
    chat_ids = AutoTokenizer.from_pretrained(str(EngineConfig().target_path)).apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with LLM(device="cpu", batch_invariant=True) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        outputs = llm.generate([*PROMPTS, list(chat_ids)], params)
    texts = [o.outputs[0].text for o in outputs]
    return {**dict(zip(PROMPTS, texts)), "chat": texts[-1]}


def _offline_params(option: dict) -> SamplingParams:
    bias = {int(t): b for t, b in option.get("logit_bias", {}).items()}
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **{**option, "logit_bias": bias})


@pytest.fixture(scope="module")
def offline_llm():
    with LLM(device="cpu", batch_invariant=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def expected_options(offline_llm) -> list[str]:
    """Offline autoregressive text of PROMPTS[0] with each of OPTIONS."""
    plain = offline_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0].text
    texts = [o.outputs[0].text for o in offline_llm.generate([PROMPTS[0]] * len(OPTIONS),
                                                             [_offline_params(o) for o in OPTIONS])]  # fmt: skip
    assert all(text != plain for text in texts), "each option must change the output, or the test proves nothing"
    return texts


@pytest.fixture(scope="module")
def client(stack, tls) -> openai.OpenAI:
    _, cert = tls
    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cert)))
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0, http_client=http, timeout=120)


def _https(stack, tls, path: str, data: bytes | None = None, key: str | None = KEY) -> tuple[int, bytes]:
    """A raw request (no SDK), for what the SDK hides: status codes of open endpoints, the SSE wire."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(stack.http_url + path, data=data, headers=headers)
    context = ssl.create_default_context(cafile=str(tls[1]))
    try:
        with urllib.request.urlopen(request, context=context, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_models_lists_the_served_model(client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].decoding == {"mode": "minedraft", "draft_method": "draft_model", "num_speculative_tokens": "3",
                                  "speculation": "adaptive"}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_offline_ar(client, expected, prompt) -> None:
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].text == expected[prompt]
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == MAX_TOKENS


def test_streamed_chunks_concatenate_to_the_same_text(client, expected) -> None:
    prompt = PROMPTS[1]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected[prompt]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_stream_is_server_sent_events_ending_with_done(stack, tls) -> None:
    body = json.dumps({"model": MODEL, "prompt": "def f():", "max_tokens": 4, "temperature": 0, "stream": True})
    status, raw = _https(stack, tls, "/v1/completions", body.encode())
    events = [line for line in raw.decode().split("\n\n") if line]
    assert status == 200
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert "usage" not in json.loads(events[0].removeprefix("data: "))  # only with include_usage


def test_chat_with_the_bundled_template(client, expected) -> None:
    done = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == expected["chat"]
    streamed = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["chat"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_vllm_extras_and_stop_strings(client, expected) -> None:
    prompt = PROMPTS[0]
    reference = expected[prompt]
    stop = reference[5:8]  # a stop string the greedy text contains
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop],
        extra_body={"top_k": 5, "ignore_eos": True},
    )  # fmt: skip
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].text == reference[: reference.index(stop)]


@pytest.mark.parametrize("index", range(len(OPTIONS)))
def test_each_sampling_option_equals_offline_ar(client, stack, tls, expected_options, index) -> None:
    """Through the SDK's own arguments where it has them, vLLM's names in extra_body otherwise, and gRPC."""
    option = OPTIONS[index]
    named = {k: v for k, v in option.items() if k in ("presence_penalty", "frequency_penalty", "logit_bias")}
    extra = {k: v for k, v in option.items() if k not in named}
    done = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, **named,
                                     extra_body=extra)  # fmt: skip
    assert done.choices[0].text == expected_options[index]
    params = _offline_params(option)
    grpc_options = {k: getattr(params, k) for k in option}
    with Client(stack.address, tls=tls[1], token=KEY, retries=0, timeout=120) as grpc_client:
        got = grpc_client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, **grpc_options)
    assert got.text == expected_options[index]


def test_logprobs_equal_offline_ar(client, stack, tls, offline_llm) -> None:
    """The served (MineDraft-mode) logprobs and top 3 of each token, completions and chat, streamed or not, and over
    gRPC, are the offline ar ones with the same option (a presence penalty: the processed distribution)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3, presence_penalty=0.5)
    out = offline_llm.generate(PROMPTS[0], params)[0].outputs[0]
    token_lps = [d[t] for t, d in zip(out.token_ids, out.logprobs)]
    top = [sorted(d.values(), reverse=True)[:3] for d in out.logprobs]
    kwargs = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "presence_penalty": 0.5}
    done = client.completions.create(prompt=PROMPTS[0], logprobs=3, **kwargs)
    assert done.choices[0].logprobs.token_logprobs == token_lps
    assert [sorted(d.values(), reverse=True) for d in done.choices[0].logprobs.top_logprobs] == top
    assert "".join(done.choices[0].logprobs.tokens) == done.choices[0].text == out.text
    chunks = list(client.completions.create(prompt=PROMPTS[0], logprobs=3, stream=True, **kwargs))
    assert [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs
            ] == token_lps  # fmt: skip
    with Client(stack.address, tls=tls[1], token=KEY, retries=0, timeout=120) as grpc_client:
        got = grpc_client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=3, presence_penalty=0.5)
    assert [t.logprob for t in got.logprobs] == token_lps and [list(t.top_logprobs) for t in got.logprobs] == top
    chat = client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=2, **kwargs)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.logprob == c.top_logprobs[0].logprob <= 0 for c in content)
    plain = client.chat.completions.create(messages=CHAT, **kwargs)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content


def test_prompt_logprobs_equal_offline(client, stack, tls, offline_llm) -> None:
    """The served (MineDraft-mode) prompt logprobs, in vLLM's shape through the SDK's extra_body, streamed or not,
    and over gRPC, are the offline ones: the first prompt token has none, each other one its logprob and rank."""
    out = offline_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2))[0]
    expected = [None] + [{str(t): d[t] for t in d} for d in out.prompt_logprobs[1:]]
    kwargs = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}
    done = client.completions.create(**kwargs, extra_body={"prompt_logprobs": 2}).model_dump()["choices"][0]
    served = done["prompt_logprobs"]
    assert len(served) == len(out.prompt_token_ids) and served[0] is None
    assert [None] + [{t: e["logprob"] for t, e in d.items()} for d in served[1:]] == expected
    for token, entry in zip(out.prompt_token_ids[1:], served[1:]):
        ranks = {t: e["rank"] for t, e in entry.items()}
        assert sorted(ranks.values()) == [1, 2] + [ranks[str(token)]] * (ranks[str(token)] > 2)
        assert entry[str(token)]["decoded_token"]
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"prompt_logprobs": 2}))
    streamed = [c.model_dump()["choices"][0].get("prompt_logprobs") for c in chunks if c.choices]
    assert [s for s in streamed if s is not None] == [served]
    with Client(stack.address, tls=tls[1], token=KEY, retries=0, timeout=120) as grpc_client:
        got = grpc_client.generate(PROMPTS[1], max_tokens=4, temperature=0, prompt_logprobs=2)
    assert [{t: v for t, v in zip(lp.top_ids, lp.top_logprobs)} | {tok: lp.logprob}
            for tok, lp in zip(out.prompt_token_ids[1:], got.prompt_logprobs)] == out.prompt_logprobs[1:]
    assert [lp.rank for lp in got.prompt_logprobs] == [served[i + 1][str(t)]["rank"]
                                                       for i, t in enumerate(out.prompt_token_ids[1:])]  # fmt: skip
    assert got.text == out.outputs[0].text


JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
               "ok": {"type": "boolean"}}, "required": ["name", "ok"]}  # fmt: skip
# (how an HTTP body asks for a grammar, the same as SamplingParams' structured_outputs)
GRAMMARS = [
    ({"guided_json": JSON_SCHEMA}, {"json": JSON_SCHEMA}),
    ({"guided_regex": "(def|class) [a-z_]{1,10}"}, {"regex": "(def|class) [a-z_]{1,10}"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"regex": "[0-9]{2,4}"}}, {"regex": "[0-9]{2,4}"}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": JSON_SCHEMA}}},
     {"json": JSON_SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
]  # fmt: skip


@pytest.mark.parametrize("index", range(len(GRAMMARS)))
def test_structured_output_equals_offline_ar(client, stack, tls, offline_llm, index) -> None:
    """Each way to ask for a grammar, on both endpoints and over gRPC: the served (MineDraft-mode) greedy text
    is the offline ar text under the same grammar."""
    body, grammar = GRAMMARS[index]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=grammar)
    text = offline_llm.generate(PROMPTS[1], params)[0].outputs[0].text
    chat_text = offline_llm.chat(CHAT, params)[0].outputs[0].text
    kwargs = {"model": MODEL, "max_tokens": 40, "temperature": 0}
    assert client.completions.create(prompt=PROMPTS[1], **kwargs, extra_body=body).choices[0].text == text
    chat = client.chat.completions.create(messages=CHAT, **kwargs, extra_body=body)
    assert chat.choices[0].message.content == chat_text
    with Client(stack.address, tls=tls[1], token=KEY, retries=0, timeout=120) as grpc_client:
        assert grpc_client.generate(PROMPTS[1], max_tokens=40, temperature=0, structured_outputs=grammar).text == text
    if "json" in grammar:
        assert json.loads(text)["ok"] in (True, False) and json.loads(chat_text)["name"].isalpha()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"guided_regex": "[a-z"}, "structured_outputs.regex"),
        ({"guided_json": {"type": "object", "properties": 3}}, "structured_outputs.json"),
        ({"response_format": {"type": "json_schema"}}, "response_format must be"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "give one structured output, not guided_regex and"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar"),
        ({"guided_choice": ["a"], "ignore_eos": True}, "cannot be combined with ignore_eos"),
    ],
)  # fmt: skip
def test_bad_structured_output_is_a_400(client, body, message) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="def f():", max_tokens=4, extra_body=body)
    assert message in info.value.body["message"], info.value.body


@pytest.mark.parametrize(
    ("grammar", "message"),
    [({"regex": "[a-z"}, "structured_outputs.regex"), ({"regex": "a", "choice": ["b"]}, "exactly one of")],
)
def test_bad_structured_output_over_grpc_is_invalid_argument(stack, tls, grammar, message) -> None:
    client = Client(stack.address, tls=tls[1], token=KEY, retries=0, timeout=120)
    with client, pytest.raises(MineDraftError) as info:
        client.generate("def f():", max_tokens=4, structured_outputs=grammar)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()


def test_several_prompts_and_samples_are_choices_in_order(client, expected) -> None:
    """A list of prompts and n samples of each: choice p * n + j is sample j of prompt p (greedy: all equal)."""
    prompts = PROMPTS[:2]
    done = client.completions.create(model=MODEL, prompt=prompts, n=2, best_of=2, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert [c.text for c in done.choices] == [expected[p] for p in prompts for _ in range(2)]
    assert done.usage.completion_tokens == 4 * MAX_TOKENS
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts]
    assert done.usage.prompt_tokens == sum(single)  # each prompt counts once, not once per sample
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True))  # fmt: skip
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)]
    assert texts == [c.text for c in done.choices]
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1, 2, 3]


def test_samples_of_one_prompt_differ_and_repeat_with_the_seed(client, expected) -> None:
    kwargs = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 11}
    first = [c.text for c in client.completions.create(**kwargs).choices]
    assert len(set(first)) == 3
    assert [c.text for c in client.completions.create(**kwargs).choices] == first
    one = client.completions.create(**{**kwargs, "n": 1}).choices[0].text
    assert one == first[0]  # sample 0 keeps the request's seed: n = 1 gives the same text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [c.message.content for c in chat.choices] == [expected["chat"]] * 2


def test_echo_puts_the_prompt_before_the_output(client, expected) -> None:
    prompt = PROMPTS[0]
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert done.choices[0].text == prompt + expected[prompt]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            echo=True, stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == prompt + expected[prompt]


def test_sampling_with_a_seed_is_reproducible(client) -> None:
    kwargs = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 7}
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": ["a"] * 9, "n": 8}, "more than the 64 choices"),
        ({"logprobs": 21}, "logprobs"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"extra_body": {"num_speculative_tokens": 4}}, "num_speculative_tokens: must be in [0, 3]"),
        ({"extra_body": {"num_speculative_tokens": -1}}, "num_speculative_tokens"),
        ({"prompt": "x " * 2000}, "max_model_len"),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(client, kwargs, message) -> None:
    kwargs = {"model": MODEL, "prompt": "def f():", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs)
    assert info.value.status_code == 400
    assert message in info.value.body["message"]
    assert info.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "fields", "named", "why"),
    [
        ("/v1/completions", {"guided_grammar": "root ::= 'a'"}, "guided_grammar", "grammars other than"),
        ("/v1/chat/completions", {"structural_tag": "{}"}, "structural_tag", "grammars other than"),
        ("/v1/completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "the grammar backend"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
         "the chat template of 'minedraft-target' does not render tools"),
        ("/v1/completions", {"tool_choice": "required"}, "tool_choice", "tool calls are for chat completions"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions", "the legacy functions API"),
        ("/v1/chat/completions", {"prompt_logprobs": 1}, "prompt_logprobs", "prompt logprobs are returned"),
        ("/v1/completions", {"echo": True, "logprobs": 1}, "echo", "echo with logprobs is not implemented"),
        ("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search", "no beam search"),
        ("/v1/completions", {"suffix": "}"}, "suffix", "suffix"),
        ("/v1/completions", {"skip_special_tokens": False}, "skip_special_tokens", "special tokens"),
        ("/v1/completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output", "stop strings"),
        ("/v1/completions", {"frobnicate": 1}, "frobnicate", "unknown field"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "refusal": "no"}]},
         "messages[0].refusal", "not implemented"),
    ],
)  # fmt: skip
def test_fields_not_implemented_are_refused_by_name(stack, tls, path, fields, named, why) -> None:
    prompt = {"prompt": "def f():"} if path == "/v1/completions" else {"messages": CHAT}
    status, raw = _https(stack, tls, path, json.dumps({"model": MODEL, "max_tokens": 4, **prompt, **fields}).encode())
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == named and f"{named} ({why}" in error["message"], error


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(client) -> None:
    """best_of 3, n 2: the two of the three samples (those n=3 gives, seeded alike) whose output tokens have the
    highest summed logprob, best first; the usage counts all three; logprobs only when asked."""
    kwargs = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "seed": 11}
    every = client.completions.create(n=3, logprobs=0, **kwargs)
    sums = [sum(c.logprobs.token_logprobs) for c in every.choices]
    assert len(set(c.text for c in every.choices)) > 1  # the samples differ, or the ranking proves nothing
    best = sorted(range(3), key=lambda i: sums[i], reverse=True)[:2]
    done = client.completions.create(n=2, best_of=3, **kwargs)
    assert [c.text for c in done.choices] == [every.choices[i].text for i in best] and done.choices[0].logprobs is None
    assert [c.index for c in done.choices] == [0, 1]
    assert done.usage.completion_tokens == every.usage.completion_tokens
    with_lps = client.completions.create(n=1, best_of=3, logprobs=1, **kwargs).choices[0]
    assert with_lps.text == every.choices[best[0]].text and sum(with_lps.logprobs.token_logprobs) == max(sums)


@pytest.mark.parametrize(
    ("fields", "why"),
    [({"best_of": 1, "n": 2}, "must be at least n"), ({"best_of": 2, "temperature": 0}, "needs random sampling"),
     ({"best_of": 2, "stream": True}, "cannot be streamed"), ({"best_of": 65}, "at most 64")],
)  # fmt: skip
def test_bad_best_of_is_a_400(stack, tls, fields, why) -> None:
    body = {"model": MODEL, "prompt": "def f():", "max_tokens": 4, **fields}
    status, raw = _https(stack, tls, "/v1/completions", json.dumps(body).encode())
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "best_of" and why in error["message"], error


def test_fields_set_to_what_the_server_does_or_ignored_on_purpose_are_accepted(client) -> None:
    extra = {"skip_special_tokens": True, "include_stop_str_in_output": False, "use_beam_search": False,
             "tool_choice": "none", "parallel_tool_calls": True, "metadata": {"team": "a"}, "store": False,
             "prompt_logprobs": None, "add_generation_prompt": True}  # fmt: skip
    done = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, user="u1",
                                          stream_options=None, extra_body=extra)  # fmt: skip
    assert done.usage.completion_tokens == 4
    done = client.completions.create(model=MODEL, prompt="def f():", max_tokens=4,
                                     extra_body={"add_special_tokens": True, "echo": False})
    assert done.usage.completion_tokens == 4


def test_images_are_one_line_400(client) -> None:
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=4)
    message = info.value.body["message"]
    assert "this model takes text only (a content part of type 'image_url')" in message and "\n" not in message
    assert message.count(";") == 0  # one complaint, not one per member of the content union


def test_max_tokens_beyond_the_context_is_a_400_naming_it(client) -> None:
    context = client.models.list().data[0].max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=context - 2)
    assert (f"maximum context length is {context} tokens. However, you requested {context + 1} tokens (3 in the "
            f"prompt, {context - 2} for the completion") in info.value.body["message"]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=context - 2)
    assert f"maximum context length is {context} tokens" in info.value.body["message"]


def test_offline_chat_renders_the_template_as_the_server(offline_llm, expected) -> None:
    out = offline_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert [o.outputs[0].text for o in out] == [expected["chat"]]
    two = offline_llm.chat([CHAT, CHAT[1:]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].text == expected["chat"][: len(two[0].outputs[0].text)]


def test_tokenize_detokenize_and_version(stack, tls, client) -> None:
    def post(path: str, body: dict) -> tuple[int, dict]:
        status, raw = _https(stack, tls, path, json.dumps(body).encode())
        return status, json.loads(raw)

    status, got = post("/tokenize", {"model": MODEL, "prompt": PROMPTS[0]})
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1)
    assert status == 200 and got["count"] == len(got["tokens"]) == completion.usage.prompt_tokens
    assert got["max_model_len"] == client.models.list().data[0].max_model_len
    assert post("/detokenize", {"tokens": got["tokens"]}) == (200, {"prompt": PROMPTS[0]})
    status, chat = post("/tokenize", {"messages": CHAT})  # model is optional
    done = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert status == 200 and chat["count"] == done.usage.prompt_tokens
    assert post("/tokenize", {"model": "gpt-4", "prompt": "x"})[0] == 404
    assert post("/tokenize", {})[0] == post("/detokenize", {"tokens": [10**9]})[0] == 400
    assert _https(stack, tls, "/tokenize", json.dumps({"prompt": "x"}).encode(), key=None)[0] == 401
    status, raw = _https(stack, tls, "/version", key=None)
    assert status == 200 and json.loads(raw)["version"]


def test_malformed_bodies_are_400_with_pydantic_messages(stack, tls, client) -> None:
    status, raw = _https(stack, tls, "/v1/chat/completions", json.dumps({"model": MODEL}).encode())
    assert status == 400
    assert "messages" in json.loads(raw)["error"]["message"]
    status, raw = _https(stack, tls, "/v1/completions", b"{not json")
    assert status == 400 and "error" in json.loads(raw)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])


def test_per_request_speculation_is_honoured_and_the_choice_is_visible(stack, tls, client, expected) -> None:
    """A request capped at 0 drafts nothing (gRPC stats) and returns the target's text; the controller's state
    (shapes, costs, acceptance) is served on GetServerInfo and the keyed debug route."""
    text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"num_speculative_tokens": 0}).choices[0].text  # fmt: skip
    assert text == expected[PROMPTS[0]]
    with Client(stack.address, tls=tls[1], token=KEY, retries=0, timeout=120) as grpc_client:
        plain = grpc_client.generate(PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, num_speculative_tokens=0)
        drafted = grpc_client.generate(PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
        state = grpc_client.server_info().speculation
    assert plain.text == drafted.text == expected[PROMPTS[1]]
    assert plain.spec_decode_stats.num_draft_tokens == 0
    assert state["shapes_allowed"] == ["overlap", "sd", "plain"] and "cost_model_seconds" in state
    status, raw = _https(stack, tls, "/debug/speculation")
    assert status == 200 and json.loads(raw)["speculation"]["acceptance_by_position"]
    assert _https(stack, tls, "/debug/speculation", key=None)[0] == 401


def test_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert client.models.retrieve(MODEL).id == MODEL


def test_model_is_optional(stack, tls) -> None:
    body = {"prompt": "def f():", "max_tokens": 3, "temperature": 0}
    status, raw = _https(stack, tls, "/v1/completions", json.dumps(body).encode())
    assert status == 200 and json.loads(raw)["model"] == MODEL


def test_a_wrong_or_missing_key_is_401(stack, tls, client) -> None:
    wrong = client.with_options(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert _https(stack, tls, "/v1/models", key=None)[0] == 401


def test_health_and_metrics_stay_open(stack, tls, client) -> None:
    client.completions.create(model=MODEL, prompt="def g():", max_tokens=8, temperature=0)
    assert _https(stack, tls, "/health", key=None)[0] == 200
    status, raw = _https(stack, tls, "/metrics", key=None)
    text = raw.decode()
    assert status == 200
    assert "minedraft:spec_decode_num_drafts_total" in text
    assert f'vllm:spec_decode_num_drafts_total{{model_name="{MODEL}"}}' in text
    assert "vllm:num_requests_running" in text
    assert ('minedraft:decoding_info{draft_method="draft_model",mode="minedraft",num_speculative_tokens="3",'
            'speculation="adaptive"} 1.0') in text
    assert "minedraft:spec_decode_plain_steps_total" in text and "minedraft:spec_decode_chosen_k_total{k=" in text
    # Answered at /metrics itself (not a redirect to /metrics/, which some scrapers do not follow).
    address = urllib.parse.urlsplit(stack.http_url)
    connection = http.client.HTTPSConnection(address.hostname, address.port, context=ssl.create_default_context(
        cafile=str(tls[1])), timeout=60)  # fmt: skip
    connection.request("GET", "/metrics")
    assert connection.getresponse().status == 200
    connection.close()


def test_grpc_needs_the_key_and_tls(stack, tls, expected) -> None:
    _, cert = tls
    with Client(stack.address, tls=cert, token=KEY, retries=0, timeout=120) as client:
        assert client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0).text == expected[PROMPTS[0]]
    for token in (None, "wrong"):
        with Client(stack.address, tls=cert, token=token, retries=0, timeout=60) as client:
            with pytest.raises(MineDraftError) as info:
                client.generate("x", max_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(MineDraftError) as info:
                client.server_info()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert client.health()  # health checks stay open
    with Client(stack.address, tls=None, token=KEY, retries=0, timeout=10) as plaintext:
        with pytest.raises(MineDraftError) as info:
            plaintext.health()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_minedraft_up_serves_the_openai_api_with_keys_from_a_file(tmp_path) -> None:
    """The command line end to end: `minedraft up --http-port --api-key-file`, then SIGTERM."""
    model = make_tiny_checkpoint(tmp_path / "tiny", arch="qwen3", num_layers=1)
    key_file = tmp_path / "keys"
    key_file.write_text("file-key\n")
    port, http_port = free_port(), free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "minedraft", "up", "--model", str(model), "--speculative-config", "null",
         "--device", "cpu", "--port", str(port), "--metrics-port", "0", "--http-port", str(http_port),
         "--api-key-file", str(key_file), "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert "is serving on" in up.stdout.readline()
        assert up.stdout.readline().strip() == f"OpenAI-compatible API: http://127.0.0.1:{http_port}/v1"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="file-key", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        assert client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3).usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="other").models.list()
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
