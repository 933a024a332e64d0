"""Chat templates render exactly as Hugging Face `transformers` renders them, and a model without one
gets a clear 400 from the OpenAI API."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import openai
import pytest
import uvicorn
from transformers import AutoTokenizer

from minedraft.config import EngineConfig
from minedraft.frontends.auth import ApiKeys
from minedraft.frontends.chat import ChatTemplate, ChatTemplateError
from minedraft.frontends.generate import Generator, Limits
from minedraft.frontends.openai_api import OpenAIFrontend
from minedraft.model.tokenizer import load_tokenizer
from minedraft.stack.local import free_port

from tiny_models import make_tiny_checkpoint

# ChatML as Qwen-style models ship it, plus what templates use: loop state, tojson, raise_exception, bos_token.
CHATML = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% if loop.last and message['role'] == 'user' %}{{ '<!-- ' + (message | tojson) + ' -->' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief. <b>ünïcode</b>"},
    {"role": "user", "content": "Say \"hi\"."},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "Again?"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("chat") / "model", arch="llama", num_layers=1)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    eos = {"__type": "AddedToken", "content": "</s>", "special": True}  # the dict form of a special token
    config.update({"chat_template": CHATML, "bos_token": "<s>", "eos_token": eos})
    config_file.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(checkpoint, add_generation_prompt) -> None:
    ours = ChatTemplate.from_checkpoint(checkpoint).render(MESSAGES, add_generation_prompt)
    theirs = AutoTokenizer.from_pretrained(str(checkpoint)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_the_bundled_template_renders_as_transformers_does() -> None:
    target = EngineConfig().target_path
    theirs = AutoTokenizer.from_pretrained(str(target)).apply_chat_template(MESSAGES, tokenize=False,
                                                                            add_generation_prompt=True)  # fmt: skip
    assert ChatTemplate.from_checkpoint(target).render(MESSAGES) == theirs
    assert theirs.endswith("user: Again?\nassistant: ")


def test_a_template_error_is_a_chat_template_error(checkpoint) -> None:
    with pytest.raises(ChatTemplateError, match="unknown role"):
        ChatTemplate.from_checkpoint(checkpoint).render([{"role": "tool", "content": "x"}])


def test_named_templates_use_the_default(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    )
    assert ChatTemplate.from_checkpoint(tmp_path).render([]) == "D"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.from_checkpoint(tmp_path) is None


def test_a_model_without_a_template_gets_a_clear_400(tmp_path) -> None:
    """The OpenAI app on a real uvicorn server; the 400 comes before any generation (no engine needed)."""
    model = make_tiny_checkpoint(tmp_path / "plain", arch="qwen3", num_layers=1)
    generator = Generator(load_tokenizer(model), Limits())
    frontend = OpenAIFrontend(generator, "plain", ChatTemplate.from_checkpoint(model), ApiKeys(), lambda: False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(frontend.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="has no chat template"):
            client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.InternalServerError) as info:  # 503: the engine is not there
            client.completions.create(model="plain", prompt="hi")
        assert info.value.status_code == 503
    finally:
        server.should_exit = True
        thread.join(10)
