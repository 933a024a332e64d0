"""Chat templates from a checkpoint's tokenizer_config.json, rendered with jinja2 as Hugging Face does.

Same environment as `transformers`' apply_chat_template: a sandbox (templates from the Hub are untrusted
code), trim_blocks and lstrip_blocks, loop controls, a `tojson` that does not escape HTML,
`raise_exception` and `strftime_now`; variables `messages`, `add_generation_prompt` and the special
tokens (`bos_token`, `eos_token`, ...).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minedraft.model.gguf import open_gguf
from minedraft.model.hub import local_folder
from minedraft.model.tokenizer import gguf_checkpoint as _gguf_checkpoint

TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template raised (`raise_exception`) or failed on these messages."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = special_tokens or {}
        environment = _environment()
        self._template = environment.from_string(source)
        # Whether the template renders `tools` (tool calls in chat need one that does).
        self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(environment.parse(source))

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ChatTemplate | None:
        """The checkpoint's default chat template, or None if it has none. A GGUF file's comes from a
        tokenizer_config.json beside it, else from its metadata (tokenizer.chat_template)."""
        gguf = _gguf_checkpoint(path)
        if gguf is not None and not (gguf.parent / TOKENIZER_CONFIG).is_file():
            opened = open_gguf(gguf)
            return cls(opened.chat_template, opened.special_token_texts()) if opened.chat_template else None
        path = gguf.parent if gguf is not None else local_folder(path)
        file = path / TOKENIZER_CONFIG
        if not file.is_file():
            return None
        config = json.loads(file.read_text(encoding="utf-8"))
        source = _default_template(config.get("chat_template"))
        if source is None:
            jinja_file = Path(path) / "chat_template.jinja"  # where newer transformers save it
            source = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None
        if source is None:
            return None
        specials = {name: _token_text(config.get(name)) for name in _SPECIAL_TOKENS}
        return cls(source, {k: v for k, v in specials.items() if v is not None})

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """`kwargs`: extra template variables (e.g. a request's chat_template_kwargs); they cannot replace
        the messages or add_generation_prompt."""
        variables = {**self.special_tokens, **kwargs, "messages": messages,
                     "add_generation_prompt": add_generation_prompt}  # fmt: skip
        try:
            return self._template.render(variables)
        except Exception as exc:  # a template is code: whatever it raises is about these inputs, not the server
            raise ChatTemplateError(f"the chat template cannot render these messages: {exc}") from exc


def _default_template(value: Any) -> str | None:
    """`chat_template` is a string, or a list of {name, template} of which "default" is the one to use."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return None


def _token_text(value: Any) -> str | None:
    """Special tokens are strings or AddedToken dicts ({"content": ...})."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
