"""Tool calls in chat through the official `openai` SDK, against a real local stack (MineDraft mode).

The served model is the bundled target under a Hermes / Qwen style chat template that renders `tools`
(written here into a copy of its tokenizer_config.json). A required or named tool choice must return calls
whose arguments validate against the tool's schema, sampled or greedy, streamed or not; auto parses the
`<tool_call>` blocks the model writes (here made to write one by a choice grammar); calls cut short by
max_tokens are still calls, as OpenAI's; the rendered prompt equals transformers' apply_chat_template with
the same tools and messages.
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from minedraft.config import BUNDLED_TARGET, EngineConfig
from minedraft.frontends.tools import Tool, ToolUse
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

HERMES_TEMPLATE = (
    "{% if tools %}{{ 'system: You may call these functions:\\n' }}{% for tool in tools %}{{ tool | tojson }}"
    "{{ '\\n' }}{% endfor %}{{ 'Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\\n' }}"
    "{% endif %}{% for message in messages %}{% if message.role == 'tool' %}"
    "{{ 'tool: <tool_response>' + message.content + '</tool_response>\\n' }}"
    "{% elif message.tool_calls %}{{ 'assistant: ' }}{% for call in message.tool_calls %}"
    "{{ '<tool_call>' }}{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "{{ '</tool_call>' }}{% endfor %}{{ '\\n' }}"
    "{% else %}{{ message.role + ': ' + message.content + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
           "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}  # fmt: skip
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
       "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tools") / "minedraft-target"
    shutil.copytree(BUNDLED_TARGET, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    return str(folder)


@pytest.fixture(scope="module")
def client(model, tmp_path_factory):
    config = EngineConfig(model=model, speculative_config={"num_speculative_tokens": 3, "is_parallel": True},
                          max_num_seqs=4, device="cpu")  # fmt: skip
    settings = scheduler_settings(http_port=free_port())
    with LocalStack(config, scheduler=settings, log_dir=tmp_path_factory.mktemp("logs")) as stack:
        yield openai.OpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_returns_valid_arguments(client) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    for seed in range(4):
        done = client.chat.completions.create(model="minedraft-target", messages=CHAT, tools=TOOLS,
                                              tool_choice=named, max_tokens=40, seed=seed)  # fmt: skip
        choice = done.choices[0]
        assert choice.finish_reason == "stop" and not choice.message.content
        _check_calls(choice.message.tool_calls, {"add"})
        assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_choice_returns_valid_calls(client, parallel: bool) -> None:
    """Sampled. With parallel calls the array is open-ended: a bias on "]" (token 61, which the grammar allows
    only after a whole call) keeps the tiny model from running on to max_tokens."""
    done = client.chat.completions.create(model="minedraft-target", messages=CHAT, tools=TOOLS, n=4, seed=1,
                                          tool_choice="required", parallel_tool_calls=parallel, max_tokens=150,
                                          logit_bias={"61": 5.0})  # fmt: skip
    for choice in done.choices:
        assert choice.finish_reason == "tool_calls", choice
        _check_calls(choice.message.tool_calls, set(SCHEMAS))
        assert parallel or len(choice.message.tool_calls) == 1


def test_streamed_tool_calls_equal_the_whole_response(client) -> None:
    kwargs = {"model": "minedraft-target", "messages": CHAT, "tools": TOOLS, "tool_choice": "required",
              "parallel_tool_calls": False, "max_tokens": 120, "temperature": 0}  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    calls = [c for chunk in chunks for d in [chunk.choices[0].delta] for c in d.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]  # fmt: skip
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_named_functions_arguments_stream_as_they_come(client) -> None:
    kwargs = {"model": "minedraft-target", "messages": CHAT, "tools": TOOLS, "max_tokens": 40, "temperature": 0,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    pieces = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert len(pieces) > 3 and pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments for p in pieces) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


def _answer(client, stream: bool, **kwargs) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a one-choice chat completion, streamed or not."""
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    content, calls = "", {}
    for delta in (chunk.choices[0].delta for chunk in chunks):
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            name, arguments = calls.get(piece.index, (piece.function.name, ""))
            calls[piece.index] = (name, arguments + (piece.function.arguments or ""))
    return content or None, [calls[i] for i in sorted(calls)], chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_arguments_cut_by_max_tokens_are_still_a_call(client, tool_choice, stream: bool) -> None:
    """As OpenAI's: tool_calls holding the arguments produced so far, and finish_reason "length"."""
    kwargs = {"model": "minedraft-target", "messages": CHAT, "tools": TOOLS, "tool_choice": tool_choice,
              "parallel_tool_calls": False, "temperature": 0}  # fmt: skip
    whole = client.chat.completions.create(**kwargs, max_tokens=120)
    (call,) = whole.choices[0].message.tool_calls
    # Eight tokens short of the whole output: inside the arguments (the tiny model's tokens are characters).
    content, calls, finish_reason = _answer(client, stream, **kwargs, max_tokens=whole.usage.completion_tokens - 8)
    assert finish_reason == "length" and not content
    ((name, arguments),) = calls
    assert name == call.function.name
    assert arguments and call.function.arguments.startswith(arguments) and arguments != call.function.arguments
    with pytest.raises(ValueError):
        json.loads(arguments)


def test_auto_parses_the_calls_the_model_writes(client) -> None:
    """The tiny model would not write a call of its own: a choice grammar makes it write one after text."""
    written = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
    kwargs = {"model": "minedraft-target", "messages": CHAT, "tools": TOOLS, "max_tokens": 300, "temperature": 0,
              "extra_body": {"guided_choice": [written]}}  # fmt: skip
    done = client.chat.completions.create(**kwargs)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}
    plain = client.chat.completions.create(model="minedraft-target", messages=CHAT, tools=TOOLS, max_tokens=8,
                                           temperature=0)  # fmt: skip
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    none = client.chat.completions.create(**kwargs, tool_choice="none")
    assert none.choices[0].message.content == written and none.choices[0].message.tool_calls is None


def test_tools_and_a_call_history_render_as_transformers_does(client, model) -> None:
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    done = client.chat.completions.create(model="minedraft-target", messages=history, tools=TOOLS, max_tokens=4,
                                          temperature=0)  # fmt: skip
    # transformers takes a call's arguments as an object; the server turns OpenAI's JSON text into one.
    call = history[1]["tool_calls"][0]
    arguments = json.loads(call["function"]["arguments"])
    as_object = {**call, "function": {**call["function"], "arguments": arguments}}
    reference = [*CHAT, {**history[1], "tool_calls": [as_object]}, history[2]]
    ids = AutoTokenizer.from_pretrained(model).apply_chat_template(reference, tools=TOOLS, add_generation_prompt=True,
                                                                   tokenize=True, return_dict=False)  # fmt: skip
    assert done.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "no tool is named 'nope'"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice: needs tools"),
    ],
)
def test_bad_tool_requests_are_400(client, kwargs, message) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="minedraft-target", messages=CHAT, max_tokens=4,
                                       **{"tools": TOOLS, **kwargs})  # fmt: skip
    assert message in info.value.body["message"], info.value.body


def test_calls_are_parsed_from_hermes_blocks() -> None:
    tools = [Tool.model_validate(t) for t in TOOLS]
    auto = ToolUse(tools, "auto", parallel=True)
    two = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
           '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')  # fmt: skip
    content, calls = auto.parse(two)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": 2},
                                                                                           {"a": 3, "b": 4}]
    assert len(ToolUse(tools, "auto", parallel=False).parse(two)[1]) == 1
    for text in ["no call here", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>']:
        assert auto.parse(text) == (text, [])


def test_cut_arrays_of_calls_keep_the_calls_whose_names_are_whole() -> None:
    required = ToolUse([Tool.model_validate(t) for t in TOOLS], "required", parallel=True)
    two = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"ci'
    content, calls = required.parse(two)
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("add", '{"a": 1, "b": 2}'), ("get_weather", '{"ci')]  # fmt: skip
    assert [c["function"]["arguments"] for c in required.parse('[{"name": "add", "arguments": ')[1]] == [""]
    for text in ['[{"name": "ad', "[", ""]:
        assert required.parse(text) == (text, [])
