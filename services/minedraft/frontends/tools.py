"""Tool calls in chat, as OpenAI's API shapes them, for chat templates that take `tools`.

- `tool_choice` "none": the tools are rendered into the prompt, the output is text.
- "auto": the output is parsed for the Hermes / Qwen style calls the templates ask for,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text around them is the content.
- "required": structured output guarantees a JSON array of one call (or more, with parallel_tool_calls) of
  the given tools, each `{"name": ..., "arguments": ...}` with arguments valid against the tool's schema.
- a named function: structured output guarantees that function's arguments (its parameters' schema).

Output cut by max_tokens under required or a named function is still calls, as OpenAI's: the arguments
hold the text produced so far and the finish reason stays "length".

Streamed, a named function's arguments go out as they come; the calls of auto and required are parsed
from the whole output, so those choices are sent whole at their finish.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from minedraft.sampling.params import Text

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_WHITESPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()
# A function with no parameters' schema takes any JSON object.
_ANY_OBJECT = {"type": "object", "additionalProperties": True}


class Function(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Text = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # arguments always follow the schema under required or named choice


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and how it may call them, resolved and checked."""

    tools: list[Tool]
    choice: str  # "none", "auto", "required", or "named"
    parallel: bool
    named: Function | None = None

    def grammar(self) -> dict[str, Any] | None:
        """The structured output that guarantees the calls (required, named), or None (auto, none)."""
        if self.named is not None:
            return {"json": self.named.parameters or _ANY_OBJECT}
        if self.choice != "required":
            return None
        calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                             "arguments": t.function.parameters or _ANY_OBJECT},
                            "required": ["name", "arguments"]} for t in self.tools]}  # fmt: skip
        return {"json": {"type": "array", "items": calls, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}}

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of an output. Under a named function the output is its arguments, whole or
        cut short; under required, the calls of the array, the last one's arguments cut short where the
        output is (a call is known once its name is whole). Text that holds no call (auto without one, an
        array cut before its first name ends) is all content, with no calls."""
        if self.named is not None:
            return _parsed_named(text, self.named.name)
        if self.choice == "required":
            return _parsed_array(text)
        if self.choice == "auto":
            content, calls = _parsed_hermes(text)
            return content, calls if self.parallel else calls[:1]
        return text, []


def resolve(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolUse | None:
    """The request's tool use, or None without tools; raises ValueError (naming the field) on a choice the
    tools cannot meet."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: needs tools")
        return None
    choice = choice or "auto"
    named = None
    if isinstance(choice, NamedToolChoice):
        named = next((t.function for t in tools if t.function.name == choice.function.name), None)
        if named is None:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
    return ToolUse(tools, "named" if named else choice, parallel is not False, named)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def _name(call: dict[str, Any]) -> str:
    if not isinstance(call["name"], str):
        raise TypeError("a tool call's name is a string")
    return call["name"]


def _parsed_named(text: str, name: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The grammar makes the output the function's arguments (cut short by max_tokens, they are the text
    produced so far, as a streamed call's pieces are)."""
    return (None, [_call(name, text)]) if text else (text, [])


def _parsed_array(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    try:
        return None, [_call(_name(c), c["arguments"]) for c in json.loads(text)]
    except (ValueError, TypeError, KeyError):
        calls = _cut_array(text)
        return (None, calls) if calls else (text, [])


def _cut_array(text: str) -> list[dict[str, Any]]:
    """The calls of an array of calls cut short: the whole ones, then the cut one if its name is whole."""
    pos, calls = _skip(text, 0), []
    if not text.startswith("[", pos):
        return []
    pos += 1
    while True:
        pos = _skip(text, pos)
        try:
            call, pos = _DECODER.raw_decode(text, pos)
            calls.append(_call(_name(call), call["arguments"]))
        except ValueError:
            cut = _cut_call(text, pos)
            return calls + ([cut] if cut else [])
        except (TypeError, KeyError):
            return []
        pos = _skip(text, pos)
        if not text.startswith(",", pos):
            return calls
        pos += 1


def _cut_call(text: str, pos: int) -> dict[str, Any] | None:
    """`{"name": ..., "arguments": ...` cut anywhere: the call with the arguments produced so far, or None
    before its name is whole."""
    if not text.startswith("{", pos):
        return None
    name, arguments, pos = None, "", pos + 1
    while True:
        try:
            key, pos = _DECODER.raw_decode(text, _skip(text, pos))
        except ValueError:
            break  # cut in a key
        pos = _skip(text, pos)
        if not text.startswith(":", pos):
            break
        start = _skip(text, pos + 1)
        try:
            value, pos = _DECODER.raw_decode(text, start)
        except ValueError:  # cut in this value
            if key == "arguments":
                arguments = text[start:]
            break
        if key == "name" and isinstance(value, str):
            name = value
        elif key == "arguments":
            arguments = json.dumps(value, ensure_ascii=False)
        pos = _skip(text, pos)
        if not text.startswith(",", pos):
            break
        pos += 1
    return _call(name, arguments) if name is not None else None


def _skip(text: str, pos: int) -> int:
    """The position of the first non-whitespace character from `pos`."""
    return _WHITESPACE.match(text, pos).end()


def _parsed_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls = []
    for block in _HERMES_CALL.findall(text):
        try:
            call = json.loads(block)
            calls.append(_call(_name(call), call.get("arguments", {})))
        except (ValueError, TypeError, KeyError):
            return text, []  # a malformed call: the whole output stays text
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls
