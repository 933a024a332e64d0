"""Flags generated from pydantic models: one flag per field, its help, bounds, choices and default from the field.

Two kinds of models become flags:

- settings (`env=True`): the engine config, the service settings and the per-process addresses (listen,
  torch.distributed, the gateway's backends). Every such flag defaults to None ("not given") in argparse;
  `model_from_args` then takes the value from the flag, else from its MINEDRAFT_<FIELD> variable (an empty
  variable counts as unset), else from the --<whole> JSON flag where the model has one, else from the
  command's `base`, else from the model's default. One rule, applied when the command runs, for every flag
  that reads the environment.
- options (`env=False`): a command's own knobs (`bench`, sampling). They read no variable: argparse holds the
  default, and `options_from_args` validates the parsed values against the model's bounds, a bad value being
  one line that names the flag (`FlagError`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

ENV_PREFIX = "MINEDRAFT_"
ModelT = typing.TypeVar("ModelT", bound=BaseModel)


class CliModel(BaseModel):
    """A model of flags that are not service settings: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class FlagError(ValueError):
    """A flag's value is out of its bounds, or flags contradict one another: one line, exit code 2."""


def as_flag(
    *, flag: str | None = None, aliases: tuple[str, ...] = (), metavar: str | None = None, repeat: bool = False
) -> dict[str, Any]:
    """How a field's flag differs from the default spelling, for `Field(json_schema_extra=...)`: another name
    (`flag`, the field staying the dest), other accepted spellings, a metavar, or repeatable (action=append)."""
    return {"flag": {"flag": flag, "aliases": aliases, "metavar": metavar, "repeat": repeat}}


def flag_name(name: str, field: FieldInfo | None = None) -> str:
    return _extra(field).get("flag") or "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _extra(field: FieldInfo | None) -> dict[str, Any]:
    extra = field.json_schema_extra if field is not None else None
    return extra.get("flag", {}) if isinstance(extra, dict) else {}


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _flag_kind(field: FieldInfo, switch: bool) -> dict[str, Any]:
    """How argparse reads a field: bool -> --x/--no-x (`switch`: a plain --x), Literal -> choices, int/float ->
    typed, list -> several values (or repeated), else a string (pydantic parses it, e.g. a JSON config)."""
    annotation = field.annotation
    kinds = [t for t in typing.get_args(annotation) if t is not type(None)] if _is_union(annotation) else [annotation]
    kind = kinds[0] if len(kinds) == 1 else str
    if kind is bool:
        return {"action": "store_true"} if switch else {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(kind) is typing.Literal and all(isinstance(v, str) for v in typing.get_args(kind)):
        return {"choices": typing.get_args(kind)}
    if typing.get_origin(kind) is list:
        return {"type": str, "action": "append"} if _extra(field).get("repeat") else {"type": str, "nargs": "+"}
    return {"type": kind if kind in (int, float) else str}


def _shown(default: Any) -> str:
    return "none" if default is None else default if isinstance(default, str) else json.dumps(default)


def add_flags(
    container: Any, model: type[BaseModel], *, env: bool = True, base: dict[str, Any] | None = None,
    aliases: bool = True, shared: typing.Collection[str] = (),
) -> None:  # fmt: skip
    """One flag per field of `model` (its own fields where it combines others) on a parser or argument group.

    `base`: a command's own defaults. `aliases`: also accept the model's deprecated field names. `shared`:
    fields whose flags another model of the same command has already added (both models read them).
    """
    for name, field in model.model_fields.items():
        if name in shared:
            continue
        extra, default = _extra(field), (base or {}).get(name, field.default)  # help names a default once
        kind = _flag_kind(field, switch=not env and default is False)
        said = "default" in (field.description or "") and default is None or not env and default in (None, False)
        help_text = field.description + ("" if said else f" (default: {_shown(default)})")
        if env:
            help_text += f" [env {env_name(name)}]"
        if extra.get("metavar"):
            kind["metavar"] = extra["metavar"]
        container.add_argument(
            flag_name(name, field), *extra.get("aliases", ()), dest=name, default=None if env else default,
            help=help_text, **kind,
        )  # fmt: skip
    for old, new in _deprecated_names(model, aliases).items():
        container.add_argument(
            flag_name(old), dest=new, default=None, action=_DeprecatedAlias,
            type=_flag_kind(model.model_fields[new], switch=False)["type"],
            help=f"deprecated alias of {flag_name(new)}, removed in the next release [env {env_name(old)}]",
        )  # fmt: skip


def add_group(
    parser: argparse.ArgumentParser, model: type[BaseModel], title: str, *, whole: str | None = None,
    base: dict[str, Any] | None = None, aliases: bool = True, shared: typing.Collection[str] = (),
) -> None:  # fmt: skip
    """`model`'s flags that read the environment, as one help group; `whole`: also --<whole>, all of the model
    as one JSON object (what a launcher starts each process with)."""
    group = parser.add_argument_group(f"{title} (each flag also reads MINEDRAFT_<FLAG>)")
    if whole:
        group.add_argument(
            flag_name(whole), dest=whole, default=None,
            help=f"all of these as one JSON object (what a launcher starts each process with); single flags "
            f"override its keys [env {env_name(whole)}]",
        )  # fmt: skip
    add_flags(group, model, base=base, aliases=aliases, shared=shared)


def _deprecated_names(model: type[BaseModel], aliases: bool = True) -> dict[str, str]:
    return getattr(model, "deprecated_names", {}) if aliases else {}


class _DeprecatedAlias(argparse.Action):
    """An old flag spelling: stores into the new flag's field and says so on stderr."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        new = flag_name(self.dest)
        print(f"minedraft: {option_string} is deprecated, use {new} (the old name goes in the next release)",
              file=sys.stderr)  # fmt: skip
        setattr(namespace, self.dest, values)


def model_from_args(
    args: argparse.Namespace, model: type[ModelT], *, whole: str | None = None, base: dict[str, Any] | None = None,
    aliases: bool = True,
) -> ModelT:  # fmt: skip
    """`model` from flags > MINEDRAFT_<FIELD> > --<whole> (MINEDRAFT_<WHOLE>) > `base` > the model's defaults.

    A bad value of a `CliModel` (a process's own flags: listen, torch.distributed, ...) is one FlagError line."""
    values = dict(base or {})
    text = (getattr(args, whole) if getattr(args, whole) is not None else os.environ.get(env_name(whole))) if whole \
        else None  # fmt: skip
    if text:
        try:
            values.update(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag_name(whole)} is not valid JSON: {exc}") from exc
    values.update(_deprecated_env(model, aliases))
    for name in model.model_fields:
        variable = os.environ.get(env_name(name))
        if variable:  # an empty variable counts as unset
            values[name] = variable
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if not issubclass(model, CliModel):  # a config or settings model: pydantic's report names the fields
        return model.model_validate(values)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise FlagError(flag_errors(exc, model)) from None


def _deprecated_env(model: type[BaseModel], aliases: bool) -> dict[str, str]:
    """Values from the deprecated MINEDRAFT_<OLD_NAME> variables (the new names, read after, win)."""
    values = {}
    for old, new in _deprecated_names(model, aliases).items():
        if os.environ.get(env_name(old)):
            print(f"minedraft: {env_name(old)} is deprecated, use {env_name(new)}", file=sys.stderr)
            values[new] = os.environ[env_name(old)]
    return values


def given_flags(args: argparse.Namespace, model: type[BaseModel]) -> list[str]:
    """The flags of `model` (settings kind) given on this command line."""
    return [flag_name(n, f) for n, f in model.model_fields.items() if getattr(args, n) is not None]


def options_from_args(args: argparse.Namespace, model: type[ModelT]) -> ModelT:
    """`model` (options kind) from the parsed flags; a value out of bounds is a FlagError naming its flag."""
    try:
        return model.model_validate({name: getattr(args, name) for name in model.model_fields})
    except ValidationError as exc:
        raise FlagError(flag_errors(exc, model)) from None


def flag_errors(exc: ValidationError, model: type[BaseModel]) -> str:
    """pydantic's errors as one line in the flags' words: `--repeats: Input should be greater than or equal to 1,
    got 0`; an error of the whole model (flags that contradict one another) is its message alone."""
    lines = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        name = error["loc"][0] if error["loc"] else None
        if isinstance(name, str) and name in model.model_fields:
            got = "" if "got " in message else f", got {error['input']!r}"
            lines.append(f"{flag_name(name, model.model_fields[name])}: {message}{got}")
        else:
            lines.append(message)
    return "; ".join(lines)
