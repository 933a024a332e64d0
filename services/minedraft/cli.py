"""`minedraft ...`: the command-line entry point (also `python -m minedraft`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from minedraft.settings import (
    BACKEND_API_KEY_ENV,
    GatewaySettings,
    ListenError,
    PublicApiSettings,
    SchedulerSettings,
    ServiceSettings,
    StartupError,
    WorkerSettings,
)
from minedraft.supervision import watch_parent_from_env

# Decoding modes of `minedraft bench` (minedraft.bench.offline.mode_configs; not imported here: torch).
MODE_NAMES = ("ar", "sd", "pearl", "minedraft", "minedraft+tetris", "sd+pard", "minedraft+pard")
OFFLINE_MODES = ",".join(MODE_NAMES[:5])
LAUNCH_MODES = "ar,sd,minedraft"


def _env(flag: str, default: Any = None) -> Any:
    """Default of a flag from its environment variable: --max-num-seqs <- MINEDRAFT_MAX_NUM_SEQS."""
    return os.environ.get("MINEDRAFT_" + flag.lstrip("-").replace("-", "_").upper(), default)


def _add(group, flag: str, default: Any = None, **kwargs) -> None:
    env = "MINEDRAFT_" + flag.lstrip("-").replace("-", "_").upper()
    help_text = kwargs.pop("help", "")
    group.add_argument(flag, default=_env(flag, default), help=f"{help_text} [env {env}]".strip(), **kwargs)


# `minedraft up` is the embedded demo: MineDraft with the bundled pair unless told otherwise.
UP_DEFAULTS = {"speculative_config": '{"num_speculative_tokens": 4, "is_parallel": true}'}
ModelT = typing.TypeVar("ModelT", bound=BaseModel)
SettingsT = typing.TypeVar("SettingsT", bound=ServiceSettings)


def _field_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_env(name: str) -> str:
    return "MINEDRAFT_" + name.upper()


def _flag_kind(annotation: Any) -> dict[str, Any]:
    """How argparse reads a field: bool -> --x/--no-x, Literal -> choices, int/float -> typed, else a string
    (pydantic parses it, e.g. the speculative config's JSON)."""
    types = [t for t in typing.get_args(annotation) if t is not type(None)] if _is_union(annotation) else [annotation]
    kind = types[0] if len(types) == 1 else str
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(kind) is typing.Literal and all(isinstance(v, str) for v in typing.get_args(kind)):
        return {"choices": typing.get_args(kind)}
    return {"type": kind if kind in (int, float) else str}


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _add_model_args(
    parser: argparse.ArgumentParser, model: type[BaseModel], whole: str, title: str,
    base: dict[str, Any] | None = None, aliases: bool = True, shared: typing.Collection[str] = (),
) -> None:  # fmt: skip
    """One flag per field of `model`, its help and default from the field, plus --<whole> for all of it as JSON.

    Every flag defaults to None ("not given"): `_model_from_args` then takes the value from the flag, else from
    its MINEDRAFT_<FIELD> variable, else from --<whole> (MINEDRAFT_<WHOLE>), else the model's default. So
    defaults live in one place, the pydantic model (`base`: a command's own defaults, e.g. up's). `aliases`:
    also accept the model's deprecated field names. `shared`: fields whose flags another model of the same
    command has already added (both models read them).
    """
    group = parser.add_argument_group(f"{title} (each flag also reads MINEDRAFT_<FLAG>)")
    group.add_argument(
        _field_flag(whole), dest=whole, default=None,
        help=f"all of these as one JSON object (what a launcher starts each process with); single flags override "
        f"its keys [env {_field_env(whole)}]",
    )  # fmt: skip
    for name, field in model.model_fields.items():
        if name in shared:
            continue
        default = (base or {}).get(name, field.default)
        default = "none" if default is None else default if isinstance(default, str) else json.dumps(default)
        group.add_argument(
            _field_flag(name), dest=name, default=None,
            help=f"{field.description} (default: {default}) [env {_field_env(name)}]", **_flag_kind(field.annotation),
        )  # fmt: skip
    for old, new in _deprecated_names(model, aliases).items():
        group.add_argument(
            _field_flag(old), dest=new, default=None, action=_DeprecatedAlias,
            type=_flag_kind(model.model_fields[new].annotation)["type"],
            help=f"deprecated alias of {_field_flag(new)}, removed in the next release [env {_field_env(old)}]",
        )  # fmt: skip


def _deprecated_names(model: type[BaseModel], aliases: bool = True) -> dict[str, str]:
    return getattr(model, "deprecated_names", {}) if aliases else {}


class _DeprecatedAlias(argparse.Action):
    """An old flag spelling: stores into the new flag's field and says so on stderr."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        new = _field_flag(self.dest)
        print(f"minedraft: {option_string} is deprecated, use {new} (the old name goes in the next release)",
              file=sys.stderr)  # fmt: skip
        setattr(namespace, self.dest, values)


def _model_from_args(
    args: argparse.Namespace, model: type[ModelT], whole: str, base: dict[str, Any] | None = None,
    aliases: bool = True,
) -> ModelT:  # fmt: skip
    """`model` from flags > MINEDRAFT_<FIELD> > --<whole> (MINEDRAFT_<WHOLE>) > `base` > the model's defaults."""
    values = dict(base or {})
    text = getattr(args, whole) if getattr(args, whole) is not None else os.environ.get(_field_env(whole))
    if text:
        try:
            values.update(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{_field_flag(whole)} is not valid JSON: {exc}") from exc
    values.update(_deprecated_env(model, aliases))
    for name in model.model_fields:
        env = os.environ.get(_field_env(name))
        if env:  # an empty variable counts as unset
            values[name] = env
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return model.model_validate(values)


def _deprecated_env(model: type[BaseModel], aliases: bool) -> dict[str, str]:
    """Values from the deprecated MINEDRAFT_<OLD_NAME> variables (the new names, read after, win)."""
    values = {}
    for old, new in _deprecated_names(model, aliases).items():
        if os.environ.get(_field_env(old)):
            print(f"minedraft: {_field_env(old)} is deprecated, use {_field_env(new)}", file=sys.stderr)
            values[new] = os.environ[_field_env(old)]
    return values


def _add_engine_args(parser: argparse.ArgumentParser, base: dict[str, Any] | None = None) -> None:
    """One flag per `EngineConfig` field, named as vLLM names them; --engine-config for the whole config."""
    from minedraft.config import EngineConfig

    _add_model_args(parser, EngineConfig, "engine_config", "engine", base)


def _engine_config(args: argparse.Namespace, base: dict[str, Any] | None = None):
    """The engine config from flags > MINEDRAFT_<FIELD> > --engine-config > `base` > EngineConfig's defaults."""
    from minedraft.config import EngineConfig

    return _model_from_args(args, EngineConfig, "engine_config", base)


def _check_model_folders(config, target: bool = True, draft: bool = True) -> None:
    """The models this process loads, where given as paths, must be folders here (a hub id is resolved, or
    refused, where it is loaded). A scheduler reads only the target's tokenizer, a drafter only the draft."""
    from minedraft.model.hub import is_hub_id

    spec = config.speculative_config
    given = [("--model", config.model if target else None),
             ("--speculative-config's model", spec.model if spec and draft else None)]  # fmt: skip
    for flag, model in given:
        if model and not is_hub_id(model) and not Path(model).expanduser().is_dir():
            raise ValueError(f"{flag} {model}: no such folder (give a checkpoint folder, or a Hugging Face id such "
                             "as Qwen/Qwen3-8B: `huggingface-cli download <id>` fetches it into the local cache)")


def _check_tls_files(settings: PublicApiSettings) -> None:
    for flag, path in (("--tls-cert", settings.tls_cert), ("--tls-key", settings.tls_key)):
        if path:
            _read_flag_file(flag, path)


def _explicit_engine_flags(args: argparse.Namespace) -> list[str]:
    from minedraft.config import EngineConfig

    given = [n for n in EngineConfig.model_fields if getattr(args, n) is not None]
    return [_field_flag(n) for n in given] + (["--engine-config"] if args.engine_config is not None else [])


def _add_settings_args(
    parser: argparse.ArgumentParser, model: type[ServiceSettings], title: str, aliases: bool = True,
    shared: typing.Collection[str] = (),
) -> None:  # fmt: skip
    _add_model_args(parser, model, model.json_name, title, aliases=aliases, shared=shared)


def _settings(args: argparse.Namespace, model: type[SettingsT], aliases: bool = True) -> SettingsT:
    return _model_from_args(args, model, model.json_name, aliases=aliases)


def _add_dist_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("torch.distributed (drafter <-> verifier tensors)")
    _add(group, "--dist-addr", "127.0.0.1", help="verifier rank 0's address (rendezvous)")
    _add(group, "--dist-port", 29500, type=int, help="rendezvous port on verifier rank 0")
    _add(group, "--dist-backend", "auto", help="auto (NCCL on CUDA, gloo on CPU), nccl, gloo")
    _add_settings_args(parser, WorkerSettings, "worker")


def _dist_config(args: argparse.Namespace):
    from minedraft.config import DistributedConfig

    return DistributedConfig(
        master_addr=args.dist_addr, master_port=args.dist_port, backend=args.dist_backend,
        timeout_s=_settings(args, WorkerSettings).dist_timeout,
        store_host=args.host,  # the store listens where the gRPC server does
    )  # fmt: skip


def _add_listen_args(parser: argparse.ArgumentParser, port: int, host: str = "0.0.0.0") -> None:
    group = parser.add_argument_group("listen")
    _add(group, "--host", host, help="address to listen on")
    _add(group, "--port", port, type=int, help="gRPC port")
    _add(group, "--log-level", "INFO", help="DEBUG, INFO, WARNING")


def _add_api_key_args(parser: argparse.ArgumentParser) -> None:
    """API keys: flags and a variable, never settings (a settings JSON travels on command lines)."""
    group = parser.add_argument_group("API keys")
    group.add_argument(
        "--api-key", action="append", default=[], help="accepted API key (repeatable); also from "
        "--api-key-file and $MINEDRAFT_API_KEYS (comma-separated). None given: no authentication",
    )  # fmt: skip
    group.add_argument("--api-key-file", action="append", default=[], help="file with one API key per line")


def _api_keys(args: argparse.Namespace):
    from minedraft.frontends.auth import ApiKeys

    try:
        return ApiKeys.load(args.api_key, args.api_key_file)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --api-key-file {getattr(exc, 'filename', None) or args.api_key_file}: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None  # fmt: skip


def _backend_access(args: argparse.Namespace, settings: GatewaySettings):
    """How the gateway reaches the schedulers: its own key (--backend-api-key-file, else
    $MINEDRAFT_BACKEND_API_KEY) and the certificates it trusts for their TLS."""
    from minedraft.gateway.pool import BackendAccess

    key = os.environ.get(BACKEND_API_KEY_ENV, "").strip() or None
    if args.backend_api_key_file:
        key = _read_flag_file("--backend-api-key-file", args.backend_api_key_file).decode().strip()
        if not key:
            raise ValueError(f"--backend-api-key-file {args.backend_api_key_file} is empty")
    ca = _read_flag_file("--backend-tls-ca", settings.backend_tls_ca) if settings.backend_tls_ca else None
    return BackendAccess(api_key=key, tls_ca=ca, tls_server_name=settings.backend_tls_server_name)


def _read_flag_file(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None


def _add_sampling_args(parser: argparse.ArgumentParser, temperature: float = 1.0, max_tokens: int = 16) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1, help="-1 = disabled")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace):
    from minedraft.sampling.params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from minedraft.llm import LLM

    params = _sampling_params(args)
    llm = LLM(**_engine_config(args).model_dump())
    try:
        outputs = llm.generate(args.prompt, params, use_tqdm=not args.json and len(args.prompt) > 1)
    finally:
        llm.close()
    for out in outputs:
        completion = out.outputs[0]
        if args.json:
            stats = out.spec_decode_stats
            record = {
                "prompt": out.prompt,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                "spec_decode_stats": {
                    "num_drafts": stats.num_drafts,
                    "num_draft_tokens": stats.num_draft_tokens,
                    "num_accepted_tokens": stats.num_accepted_tokens,
                    "num_accepted_tokens_per_pos": stats.num_accepted_tokens_per_pos,
                },
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(out.prompt + completion.text)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from minedraft.bench.prompts import load_prompts

    _check_bench_args(args)
    prompts = load_prompts(args.dataset, limit=args.num_prompts)
    if args.offline:
        return _bench_offline(args, prompts)
    try:
        if args.k8s:
            return _bench_k8s(args, prompts)
        return _bench_launch(args, prompts) if args.launch else _bench_target(args, prompts)
    except (RuntimeError, TimeoutError, ConnectionError, LookupError) as exc:  # a server that did not start or answer
        print(f"minedraft bench: {exc}", file=sys.stderr)
        return 1


def _check_bench_args(args: argparse.Namespace) -> None:
    """Errors a user can fix, before loading anything: raised as ValueError, printed by main()."""
    checks = [
        (args.num_prompts >= 1, f"--num-prompts must be >= 1, got {args.num_prompts}"),
        (args.concurrency >= 1, f"--concurrency must be >= 1, got {args.concurrency}"),
        (args.request_rate is None or args.request_rate > 0, f"--request-rate must be > 0, got {args.request_rate}"),
        (args.max_tokens >= 1, f"--max-tokens must be >= 1, got {args.max_tokens}"),
        (args.temperature >= 0, f"--temperature must be >= 0, got {args.temperature}"),
        (args.timeout > 0, f"--timeout must be > 0 seconds, got {args.timeout}"),
        (args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}"),
        (args.k is None or args.k >= 1, f"--k must be >= 1, got {args.k}"),
        (args.repeats >= 1, f"--repeats must be >= 1, got {args.repeats}"),
        (args.target is None or ":" in args.target, f"--target must be host:port, got {args.target!r}"),
        (args.metrics_url is None or args.target is not None or args.k8s, "--metrics-url goes with --target or "
         "--k8s (--launch scrapes each stack it starts)"),
        (args.json is None or not args.offline, "--json is available with --target and --launch"),
        (args.draft_model is None or args.launch, "--draft-model goes with --launch"),
        (args.offline or args.launch or not _explicit_engine_flags(args), "engine flags ("
         f"{', '.join(_explicit_engine_flags(args))}) configure the engines that --offline and --launch start; "
         "a running server (--target, --k8s) keeps its own"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _bench_offline(args: argparse.Namespace, prompts: list[str]) -> int:
    from minedraft.bench.offline import format_table, run_offline_bench

    engine, speculative = _bench_engines(args)
    modes = (args.modes or OFFLINE_MODES).split(",")
    results = run_offline_bench(prompts, modes, speculative, _sampling_params(args), repeats=args.repeats, **engine)
    print(format_table(results))
    return 0


def _bench_engines(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine settings of every compared mode, and the speculative keys the modes share.

    --speculative-config gives those keys (k, draft model, Tetris knobs; each mode sets is_parallel,
    force_pearl and tetris itself); --k and --draft-model are shorthands that may not contradict it.
    """
    config = _engine_config(args)
    engine = config.model_dump(exclude={"speculative_config"})
    spec = config.speculative_config
    shared = spec.model_dump(exclude_none=True) if spec else {"num_speculative_tokens": 4}
    for flag, key, value in (("--k", "num_speculative_tokens", args.k), ("--draft-model", "model", args.draft_model)):
        if value is None:
            continue
        if spec is not None and shared.get(key) not in (None, value):
            raise ValueError(f"{flag} {value} contradicts --speculative-config's {key} ({shared[key]}); give one")
        shared[key] = value
    return engine, shared


def _online_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """run_online_bench options shared by --target and --launch."""
    return {
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "ignore_eos": args.ignore_eos,
        "stop": args.stop,
        "seed": args.sampling_seed if args.sampling_seed is not None else _engine_config(args).seed,
        "timeout": args.timeout,
        "warmup": args.warmup,
    }


def _bench_target(args: argparse.Namespace, prompts: list[str]) -> int:
    from minedraft.bench.online import format_result, run_online_bench, to_json

    result = run_online_bench(args.target, prompts, metrics_url=args.metrics_url, **_online_kwargs(args))
    print(format_result(result))
    if args.json:
        Path(args.json).write_text(to_json(result, per_request=True) + "\n", encoding="utf-8")
    return 0 if not result.failed else 1


def _bench_k8s(args: argparse.Namespace, prompts: list[str]) -> int:
    """The --target benchmark through a port-forward to the release's public Service, closed afterwards."""
    from minedraft.bench.k8s import SCHEDULER_PORT, port_forward

    with port_forward(args.service, args.namespace, method=args.port_forward) as target:
        print(f"forwarding {target} -> svc/{args.service}:{SCHEDULER_PORT} in namespace {args.namespace}", flush=True)
        args.target = target
        return _bench_target(args, prompts)


def _bench_launch(args: argparse.Namespace, prompts: list[str]) -> int:
    import tempfile

    from minedraft.bench.launch import format_comparison, greedy_mismatches, run_launch_bench
    from minedraft.bench.online import to_json

    engine, speculative = _bench_engines(args)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="minedraft-bench-"))
    modes = (args.modes or LAUNCH_MODES).split(",")
    try:
        results = run_launch_bench(
            modes, speculative, engine, prompts, log_dir=log_dir, log_level=args.log_level,
            repeats=args.repeats, **_online_kwargs(args),
        )  # fmt: skip
    except (RuntimeError, TimeoutError, ConnectionError) as exc:
        raise RuntimeError(f"{exc} (service logs: {log_dir})") from exc
    print(format_comparison(results))
    if args.temperature == 0:
        for mode, count in greedy_mismatches(results).items():
            if count:
                print(f"warning: {count} greedy outputs of {mode} differ from {modes[0]}'s", flush=True)
    if args.json:
        Path(args.json).write_text(to_json(results, per_request=True) + "\n", encoding="utf-8")
    return 0 if not any(r.failed for r in results.values()) else 1


def cmd_verifier(args: argparse.Namespace) -> int:
    from minedraft.serving import configure_logging
    from minedraft.verifier.service import serve_verifier

    config = _engine_config(args)
    _check_model_folders(config, draft=False)
    configure_logging(args.log_level)
    serve_verifier(config, _dist_config(args), _settings(args, WorkerSettings), args.host, args.port)
    return 0


def cmd_drafter(args: argparse.Namespace) -> int:
    from minedraft.drafter.service import serve_drafter
    from minedraft.serving import configure_logging

    config = _engine_config(args)
    _check_model_folders(config, target=False)
    configure_logging(args.log_level)
    serve_drafter(config, _dist_config(args), _settings(args, WorkerSettings), args.host, args.port)
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    from minedraft.scheduler_server import PublicApi, serve_scheduler
    from minedraft.serving import configure_logging

    api = PublicApi(_settings(args, SchedulerSettings), host=args.host, port=args.port, api_keys=_api_keys(args))
    _check_tls_files(api.settings)
    config = _engine_config(args)
    _check_model_folders(config, draft=False)
    configure_logging(args.log_level)
    asyncio.run(serve_scheduler(config, api, verifier=args.verifier, drafter=args.drafter))
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _up_stack(args: argparse.Namespace):
    """What `minedraft up` starts (not started yet): one engine group, or N behind a gateway."""
    from minedraft.gateway.local import GatewayStack
    from minedraft.launcher import LocalStack

    config = _engine_config(args, base=UP_DEFAULTS)
    _check_model_folders(config)
    if args.engine_groups < 1:
        raise ValueError(f"--engine-groups must be >= 1, got {args.engine_groups}")
    scheduler, keys = _settings(args, SchedulerSettings), _api_keys(args)
    _check_tls_files(scheduler)
    options = {"host": args.host, "port": args.port, "log_level": args.log_level, "scheduler": scheduler,
               "worker": _settings(args, WorkerSettings, aliases=False)}  # fmt: skip
    if args.engine_groups == 1:
        return LocalStack(config, **options, api_keys=keys.keys)
    # The gateway is the public edge: it takes the public flags; the groups behind it serve gRPC to it alone,
    # in plaintext on this machine.
    gateway = _settings(args, GatewaySettings)
    if gateway.backend_tls_ca or gateway.backend_tls_server_name:
        raise ValueError("--backend-tls-ca and --backend-tls-server-name do not apply to up: its engine groups "
                         "serve the gateway in plaintext on this machine (--tls-cert puts TLS on the gateway)")
    options["scheduler"] = scheduler.model_copy(update={"http_port": 0, "tls_cert": None, "tls_key": None})
    return GatewayStack(config, args.engine_groups, **options, gateway=gateway, api_keys=keys.keys)


def cmd_up(args: argparse.Namespace) -> int:
    stack = _up_stack(args)  # validate before starting anything
    # SIGTERM (and SIGINT, even when a non-interactive shell started us with it ignored) stop the stack
    # through the context manager, so no service process is left behind.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    with stack:
        groups = f", {args.engine_groups} engine groups behind a gateway" if args.engine_groups > 1 else ""
        print(f"MineDraft ({stack.config.mode.value}{groups}) is serving on {stack.address}; Ctrl-C stops it",
              flush=True)  # fmt: skip
        if stack.http_url:
            print(f"OpenAI-compatible API: {stack.http_url}/v1", flush=True)
        metrics_port = _settings(args, SchedulerSettings).metrics_port
        if metrics_port:
            print(f"Prometheus metrics: http://{args.host}:{metrics_port}/metrics"
                  + (" (group i: port + i)" if args.engine_groups > 1 else ""), flush=True)  # fmt: skip
        stack.wait()
        return _report_exited(stack.exited())


def _report_exited(exited: list[tuple[str, int]]) -> int:
    """`minedraft up`'s exit code: 0 after a signal, 1 when a service died on its own (named on stderr)."""
    for name, code in exited:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        print(f"minedraft up: the {name} {how}; stopping the other services", file=sys.stderr, flush=True)
    return 1 if exited else 0


def _backends(value: list[str] | str | None) -> list[str]:
    """--backend (repeatable), or MINEDRAFT_BACKEND as a comma-separated list."""
    items = value.split(",") if isinstance(value, str) else value or []
    from minedraft.gateway.service import parse_backend

    backends = [b.strip() for b in items if b.strip()]
    for backend in backends:
        parse_backend(backend)  # ValueError: printed by main()
    return backends


def cmd_gateway(args: argparse.Namespace) -> int:
    from minedraft.config import EngineConfig
    from minedraft.gateway.service import GatewayApi, serve_gateway
    from minedraft.serving import configure_logging

    if bool(_backends(args.backend)) == bool(args.k8s_service):
        raise ValueError("give the engine groups either as --backend HOST:PORT (repeatable) or as --k8s-service")
    settings = _settings(args, GatewaySettings)
    _check_tls_files(settings)
    api = GatewayApi(settings, host=args.host, port=args.port, api_keys=_api_keys(args),
                     access=_backend_access(args, settings))  # fmt: skip
    tokenizer = args.tokenizer or str(EngineConfig().target_path)
    if not Path(tokenizer).is_dir():
        raise ValueError(f"--tokenizer {tokenizer}: no such folder (the target checkpoint's, with tokenizer.json)")
    configure_logging(args.log_level)
    asyncio.run(
        serve_gateway(
            api, tokenizer_path=tokenizer, backends=_backends(args.backend), k8s_service=args.k8s_service,
            namespace=args.namespace, port_name=args.port_name,
        )
    )  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minedraft", description="MineDraft: batch parallel speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text in this process (offline API)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser(
        "bench",
        help="benchmark decoding modes: in this process (--offline), against a server (--target), or on local "
        "stacks started mode by mode (--launch)",
        description="Three ways to benchmark. --offline: the engine in this process, mode by mode (tokens/s, "
        "accepted length). --target HOST:PORT: streamed requests against a running server, measured at the "
        "client (TTFT, ITL, E2E, throughput). --launch: for each of --modes, start verifier, drafter and "
        "scheduler locally (the engine flags apply), run the --target benchmark on it, stop it; then one "
        "side-by-side table. With --offline and --launch, --speculative-config gives the keys the speculative modes "
        "share (k, draft model, Tetris knobs); each mode sets is_parallel, force_pearl and tetris itself. "
        "See benchmarks/README.md.",
    )
    how = bench.add_mutually_exclusive_group(required=True)
    how.add_argument("--offline", action="store_true", help="run the engine in this process, mode by mode")
    how.add_argument("--target", metavar="HOST:PORT", help="benchmark the MineDraft server at this address")
    how.add_argument("--launch", action="store_true", help="start a local stack per mode and benchmark each")
    how.add_argument(
        "--k8s", action="store_true", help="benchmark a release in Kubernetes through a port-forward to its gateway"
    )
    k8s = bench.add_argument_group("kubernetes (--k8s)")
    k8s.add_argument("--namespace", default="default", help="namespace of the release")
    k8s.add_argument(
        "--service",
        default="minedraft-gateway",
        help="the release's public Service: <release>-gateway (the chart's default), or <release>-scheduler "
        "where the gateway is off",
    )
    k8s.add_argument(
        "--port-forward",
        choices=("kubectl", "client"),
        default="kubectl",
        help="kubectl: `kubectl port-forward svc/...` as a subprocess; client: the kubernetes Python client",
    )
    bench.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated modes to compare, of {','.join(MODE_NAMES)} (+pard: parallel drafting with the "
        f"PARD draft); default: {OFFLINE_MODES} "
        f"with --offline, {LAUNCH_MODES} with --launch",
    )
    bench.add_argument(
        "--k",
        type=int,
        default=None,
        help="num_speculative_tokens of the speculative modes (default 4); a shorthand for --speculative-config's "
        "key, which it may not contradict",
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="--offline / --launch: interleaved rounds over all modes; each mode's median is reported",
    )
    bench.add_argument(
        "--dataset", default=None, help="prompts: .jsonl of {prompt} or ShareGPT .json; default: bundled held-out"
    )
    bench.add_argument("--num-prompts", type=int, default=64, help="use the first N prompts of the dataset")
    online = bench.add_argument_group("online (--target, --launch)")
    online.add_argument("--concurrency", type=int, default=16, help="most requests in flight at once")
    online.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests per second, arriving as a Poisson process (still capped by --concurrency); "
        "default: send as fast as the concurrency allows",
    )
    online.add_argument("--timeout", type=float, default=600.0, help="per-request deadline in seconds")
    online.add_argument(
        "--warmup", type=int, default=2, help="requests sent (and not measured) before the run, per server"
    )
    online.add_argument(
        "--metrics-url",
        default=None,
        help="--target only: the scheduler's Prometheus endpoint (e.g. http://127.0.0.1:7450/metrics), scraped "
        "before and after the run for step times, overhead and overlap",
    )
    online.add_argument("--json", metavar="FILE", default=None, help="also write the results, per request, as JSON")
    online.add_argument(
        "--draft-model", default=None, help="--launch: draft checkpoint of the speculative modes; default: bundled"
    )
    online.add_argument("--log-dir", default=None, help="--launch: service logs; default: a new temporary folder")
    online.add_argument("--log-level", default="INFO", help="--launch: the services' log level")
    _add_engine_args(bench)
    _add_sampling_args(bench, temperature=0.0, max_tokens=64)
    bench.set_defaults(func=cmd_bench)

    up = sub.add_parser(
        "up",
        help="start verifier, drafter and scheduler as local processes (the embedded default)",
        description="Start the whole stack on this machine with the bundled models, in MineDraft mode unless "
        "--speculative-config says otherwise ('null' = plain autoregressive decoding).",
    )
    _add_engine_args(up, base=UP_DEFAULTS)
    _add_listen_args(up, port=50051, host="127.0.0.1")
    _add(
        up, "--engine-groups", 1, type=int,
        help="engine groups (verifier, drafter, scheduler each); above 1 a gateway serves at --port in front of them",
    )  # fmt: skip
    _add_api_key_args(up)
    _add_settings_args(up, SchedulerSettings, "scheduler (of every engine group; metrics port: group i gets port + i)")
    _add_settings_args(up, WorkerSettings, "workers (drafter and verifier of every engine group)", aliases=False)
    _add_settings_args(up, GatewaySettings, "gateway (with --engine-groups above 1: it serves the public flags "
                       "above, --http-port, keys and TLS)", shared=PublicApiSettings.model_fields)
    up.set_defaults(func=cmd_up)

    gateway = sub.add_parser(
        "gateway",
        help="run the gateway: the public gRPC and OpenAI HTTP APIs in front of N engine groups, with request "
        "migration",
        description="Routes each request to the serving engine group (scheduler) with the least outstanding work "
        "and, when that group fails mid-request, resubmits prompt + tokens streamed so far to another one; the "
        "client's stream continues. Stateless: run as many replicas as you like.",
    )
    _add_listen_args(gateway, port=50050)
    _add(gateway, "--backend", None, action="append", help="a scheduler's HOST:PORT, or HOST:PORT@METRICS_PORT to "
         "route by its queue too (repeatable; the variable: comma-separated)")  # fmt: skip
    _add(gateway, "--k8s-service", None, help="discover the schedulers from this Service's EndpointSlices instead")
    _add(gateway, "--namespace", "default", help="namespace of --k8s-service")
    _add(gateway, "--port-name", "grpc", help="the scheduler port's name in the EndpointSlices")
    _add(gateway, "--tokenizer", None, help="folder of the target's tokenizer.json (text is "
         "derived at the gateway, exact across a migration); default: the bundled target")  # fmt: skip
    _add_api_key_args(gateway)
    gateway.add_argument(
        "--backend-api-key-file", default=None, help="file with the gateway's own API key, sent to the schedulers "
        f"(never a client's key); also from ${BACKEND_API_KEY_ENV}. None: the schedulers take no key",
    )  # fmt: skip
    _add_settings_args(gateway, GatewaySettings, "gateway")
    gateway.set_defaults(func=cmd_gateway)

    verifier = sub.add_parser("verifier", help="run the verifier service (all tensor-parallel ranks), as a pod does")
    _add_engine_args(verifier)
    _add_listen_args(verifier, port=50061)
    _add_dist_args(verifier)
    verifier.set_defaults(func=cmd_verifier)

    drafter = sub.add_parser("drafter", help="run the drafter service, as a pod does")
    _add_engine_args(drafter)
    _add_listen_args(drafter, port=50062)
    _add_dist_args(drafter)
    drafter.set_defaults(func=cmd_drafter)

    scheduler = sub.add_parser("scheduler", help="run the scheduler (public gRPC and OpenAI HTTP APIs), as a pod does")
    _add_engine_args(scheduler)
    _add_listen_args(scheduler, port=50051)
    _add(scheduler, "--verifier", "127.0.0.1:50061", help="verifier rank 0's gRPC address")
    _add(scheduler, "--drafter", "127.0.0.1:50062", help="drafter's gRPC address (ignored without speculation)")
    _add_api_key_args(scheduler)
    _add_settings_args(scheduler, SchedulerSettings, "scheduler")
    scheduler.set_defaults(func=cmd_scheduler)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    watch_parent_from_env()  # a service started by `minedraft up` stops when it is gone
    try:
        return args.func(args)
    except ValidationError as exc:
        print(f"minedraft {args.command}: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, ListenError, StartupError) as exc:
        print(f"minedraft {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
