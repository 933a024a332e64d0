"""What several commands share: the engine's flags, the service settings, listening, API keys, sampling and the
checks of the files and folders that flags name."""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any

from pydantic import Field

from minedraft.cli.flags import CliModel, add_flags, add_group, as_flag, model_from_args, options_from_args
from minedraft.config import EngineConfig
from minedraft.settings import PublicApiSettings, ServiceSettings

SettingsT = typing.TypeVar("SettingsT", bound=ServiceSettings)


def add_engine_args(parser: argparse.ArgumentParser, base: dict[str, Any] | None = None) -> None:
    """One flag per `EngineConfig` field, named as vLLM names them; --engine-config for the whole config."""
    add_group(parser, EngineConfig, "engine", whole="engine_config", base=base)


def engine_config(args: argparse.Namespace, base: dict[str, Any] | None = None) -> EngineConfig:
    """The engine config from flags > MINEDRAFT_<FIELD> > --engine-config > `base` > EngineConfig's defaults."""
    return model_from_args(args, EngineConfig, whole="engine_config", base=base)


def add_settings_args(
    parser: argparse.ArgumentParser, model: type[ServiceSettings], title: str, aliases: bool = True,
    shared: typing.Collection[str] = (),
) -> None:  # fmt: skip
    add_group(parser, model, title, whole=model.json_name, aliases=aliases, shared=shared)


def settings(args: argparse.Namespace, model: type[SettingsT], aliases: bool = True) -> SettingsT:
    return model_from_args(args, model, whole=model.json_name, aliases=aliases)


class ListenSettings(CliModel):
    """Where a service listens, and how much it logs (a process's own: never handed to a child whole)."""

    host: str = Field("0.0.0.0", description="address to listen on")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING")


def add_listen_args(parser: argparse.ArgumentParser, listen: dict[str, Any]) -> None:
    """--host, --port, --log-level; `listen`: the command's defaults (its port, for one)."""
    add_group(parser, ListenSettings, "listen", base=listen)
    parser.set_defaults(listen_defaults=listen)


def listen_settings(args: argparse.Namespace) -> ListenSettings:
    return model_from_args(args, ListenSettings, base=args.listen_defaults)


def add_api_key_args(parser: argparse.ArgumentParser) -> None:
    """API keys: flags and a variable, never settings (a settings JSON travels on command lines)."""
    group = parser.add_argument_group("API keys")
    group.add_argument(
        "--api-key", action="append", default=[], help="accepted API key (repeatable); also from "
        "--api-key-file and $MINEDRAFT_API_KEYS (comma-separated). None given: no authentication",
    )  # fmt: skip
    group.add_argument("--api-key-file", action="append", default=[], help="file with one API key per line")


def api_keys(args: argparse.Namespace):
    from minedraft.frontends.auth import ApiKeys

    try:
        return ApiKeys.load(args.api_key, args.api_key_file)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --api-key-file {getattr(exc, 'filename', None) or args.api_key_file}: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None  # fmt: skip


class SamplingOptions(CliModel):
    """How a command samples: what `SamplingParams` takes, with the same bounds."""

    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="keep the smallest set of tokens with this mass")
    top_k: int = Field(-1, ge=-1, description="keep the k most likely tokens; -1 = disabled")
    max_tokens: int = Field(16, ge=1, description="most tokens to generate per request")
    sampling_seed: int | None = Field(None, ge=0, description="per-request seed")
    stop: list[str] | None = Field(None, description="stop string (repeatable)", json_schema_extra=as_flag(repeat=True))
    ignore_eos: bool = Field(False, description="generate until max_tokens, past the end-of-sequence token")

    def params(self):
        from minedraft.sampling.params import SamplingParams

        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_tokens,
            seed=self.sampling_seed, stop=self.stop, ignore_eos=self.ignore_eos,
        )  # fmt: skip


def add_sampling_args(parser: argparse.ArgumentParser, temperature: float = 1.0, max_tokens: int = 16) -> None:
    add_flags(parser.add_argument_group("sampling"), SamplingOptions, env=False,
              base={"temperature": temperature, "max_tokens": max_tokens})  # fmt: skip


def sampling_options(args: argparse.Namespace) -> SamplingOptions:
    return options_from_args(args, SamplingOptions)


def check_model_folders(config: EngineConfig, target: bool = True, draft: bool = True) -> None:
    """The models this process loads, where given as paths, must be here: a folder, or a GGUF file (a hub id or a
    packaged model's name is resolved, or refused, where it is loaded). A scheduler reads only the target's
    tokenizer, a drafter only the draft."""
    spec = config.speculative_config
    given = [("--model", config.model if target else None),
             ("--speculative-config's model", spec.model if spec and draft else None)]  # fmt: skip
    for flag, model in given:
        if model and not checkpoint_given(model):
            raise ValueError(f"{flag} {model}: no such folder or .gguf file (give a checkpoint folder, a GGUF file, "
                             "a packaged model such as smollm2-135m-instruct, or a Hugging Face id such as "
                             "Qwen/Qwen3-8B: `huggingface-cli download <id>` fetches it into the local cache)")


def checkpoint_given(model: str) -> bool:
    """A folder or a .gguf file here, a hub id, or a packaged model's name."""
    from minedraft.config import packaged_model
    from minedraft.model.gguf import is_gguf
    from minedraft.model.hub import is_hub_id

    path = Path(model).expanduser()
    return path.is_dir() or (path.is_file() and is_gguf(path)) or is_hub_id(model) or packaged_model(model) is not None


def check_tls_files(settings: PublicApiSettings) -> None:
    for flag, path in (("--tls-cert", settings.tls_cert), ("--tls-key", settings.tls_key)):
        if path:
            read_flag_file(flag, path)


def read_flag_file(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
