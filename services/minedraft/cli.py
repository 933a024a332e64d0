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

from minedraft.bench import CHAOS_ROLES
from minedraft.extras import require
from minedraft.settings import (
    BACKEND_API_KEY_ENV,
    GatewaySettings,
    ListenError,
    PublicApiSettings,
    SchedulerSettings,
    ServiceSettings,
    StartupError,
    SupervisorSettings,
    WorkerSettings,
)
from minedraft.supervision import Supervisor, watch_parent_from_env

# Decoding modes of `minedraft bench` (minedraft.bench.offline.mode_configs; not imported here: torch).
MODE_NAMES = ("ar", "sd", "pearl", "minedraft", "minedraft+tetris", "sd+pard", "minedraft+pard", "sd+eagle3",
              "pearl+eagle3", "minedraft+eagle3", "sd+p-eagle", "minedraft+p-eagle")
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
    if typing.get_origin(kind) is list:  # --lora-modules a=/x b=/y
        return {"type": str, "nargs": "+"}
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
    _check_bench_args(args)
    requests = _bench_requests(args)
    if args.chaos:
        return _bench_chaos(args, requests)
    if args.offline:
        return _bench_offline(args, [r.prompt for r in requests])
    try:
        if args.k8s:
            return _bench_k8s(args, requests)
        return _bench_launch(args, requests) if args.launch else _bench_server(args, requests)
    except (RuntimeError, TimeoutError, ConnectionError, LookupError) as exc:  # a server that did not start or answer
        print(f"minedraft bench: {exc}", file=sys.stderr)
        return 1


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from minedraft.bench.report import compare_files

    print(compare_files(args.a, args.b))
    return 0


def _bench_backend(args: argparse.Namespace) -> str:
    return args.backend or ("openai" if args.base_url else "minedraft-grpc")


def _check_bench_args(args: argparse.Namespace) -> None:
    """Errors a user can fix, before loading anything: raised as ValueError, printed by main()."""
    backend, server = _bench_backend(args), args.target or args.base_url
    ways = [args.offline, bool(args.target), bool(args.base_url), args.launch, args.k8s]
    checks = [
        (sum(ways) == 1, "give one of --offline, --target, --base-url, --launch, --k8s (or `bench compare A B`)"),
        (args.num_prompts >= 1, f"--num-prompts must be >= 1, got {args.num_prompts}"),
        (args.concurrency >= 1, f"--concurrency must be >= 1, got {args.concurrency}"),
        (args.request_rate is None or args.request_rate > 0, f"--request-rate must be > 0, got {args.request_rate}"),
        (args.burstiness > 0, f"--burstiness must be > 0, got {args.burstiness}"),
        (args.max_tokens >= 1, f"--max-tokens must be >= 1, got {args.max_tokens}"),
        (args.temperature >= 0, f"--temperature must be >= 0, got {args.temperature}"),
        (args.timeout > 0, f"--timeout must be > 0 seconds, got {args.timeout}"),
        (args.progress_interval > 0, f"--progress-interval must be > 0 seconds, got {args.progress_interval}"),
        (args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}"),
        (args.k is None or args.k >= 1, f"--k must be >= 1, got {args.k}"),
        (args.repeats >= 1, f"--repeats must be >= 1, got {args.repeats}"),
        (args.input_len >= 1, f"--input-len must be >= 1, got {args.input_len}"),
        (args.output_len is None or args.output_len >= 1, f"--output-len must be >= 1, got {args.output_len}"),
        (0 <= args.random_range_ratio < 1, f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}"),
        (args.target is None or ":" in args.target, f"--target must be host:port, got {args.target!r}"),
        (args.base_url is None or args.base_url.startswith(("http://", "https://")),
         f"--base-url must be an http:// or https:// URL, got {args.base_url!r}"),
        (backend == "minedraft-grpc" or args.base_url, f"--backend {backend} needs --base-url http://HOST:PORT"),
        (backend != "minedraft-grpc" or not args.base_url, "--base-url is for --backend openai or openai-chat; "
         "a MineDraft gRPC server is --target HOST:PORT"),
        ((args.ramp_up_strategy is None) == (args.ramp_up_start_rps is None) == (args.ramp_up_end_rps is None),
         "--ramp-up-strategy goes with --ramp-up-start-rps and --ramp-up-end-rps"),
        (args.ramp_up_strategy is None or args.request_rate is None, "--ramp-up-* sets the rate: no --request-rate"),
        (args.metrics_url is None or server or args.k8s, "--metrics-url goes with --target, --base-url or "
         "--k8s (--launch scrapes each stack it starts)"),
        (not args.sweep_concurrency or server or args.k8s, "--sweep-concurrency goes with --target, --base-url or "
         "--k8s"),
        (not args.offline or not (args.json or args.trace or args.plot), "--json, --trace and --plot are for the "
         "online benchmarks"),
        (args.draft_model is None or args.launch, "--draft-model goes with --launch"),
        (not args.chaos or args.target, "--chaos needs --target HOST:PORT, a `minedraft up` on this machine (it "
         "kills up's services by pid; not --offline, --base-url, --launch or --k8s)"),
        (args.chaos_interval > 0 and args.chaos_duration > 0, "--chaos-interval and --chaos-duration must be > 0"),
        (set(args.chaos_targets.split(",")) <= set(CHAOS_ROLES),
         f"--chaos-targets: roles of {','.join(CHAOS_ROLES)}, got {args.chaos_targets!r}"),
        (args.offline or args.launch or not _explicit_engine_flags(args), "engine flags ("
         f"{', '.join(_explicit_engine_flags(args))}) configure the engines that --offline and --launch start; "
         "a running server (--target, --base-url, --k8s) keeps its own"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    if args.plot:
        require("matplotlib", "--plot")


def _bench_requests(args: argparse.Namespace) -> list:
    """The dataset's requests: random token prompts of --input-len, or the prompts of a file."""
    from minedraft.bench.prompts import RANDOM, BenchRequest, load_prompts, random_requests

    if args.dataset != RANDOM:
        return [BenchRequest(p) for p in load_prompts(args.dataset, limit=args.num_prompts)]
    output_len = args.output_len or args.max_tokens
    return random_requests(_bench_tokenizer(args), args.num_prompts, args.input_len, output_len,
                           args.random_range_ratio, seed=args.sampling_seed or 0)  # fmt: skip


def _bench_chaos(args: argparse.Namespace, requests: list) -> int:
    """`bench --chaos`: token-id prompts (a stream broken by a kill is then resumed by the SDK), greedy."""
    from minedraft.bench.chaos import Chaos, Load, Stack, find_up, run_chaos

    try:
        stack = Stack(find_up(int(args.target.rsplit(":", 1)[1])))
    except LookupError as exc:
        print(f"minedraft bench: {exc}", file=sys.stderr)
        return 1
    tokenizer = _bench_tokenizer(args)
    prompts = [tokenizer.encode(r.prompt) for r in requests]
    token = args.bench_api_key or os.environ.get("OPENAI_API_KEY")
    load = Load(args.target, prompts, args.concurrency, args.max_tokens, token)
    chaos = Chaos(args.chaos_interval, args.chaos_duration, args.chaos_targets.split(","))
    text, clean = run_chaos(stack, load, chaos, out=lambda line: print(line, flush=True))
    print(text)
    return 0 if clean else 1


def _bench_tokenizer(args: argparse.Namespace):
    from minedraft.config import EngineConfig
    from minedraft.model.tokenizer import load_tokenizer

    return load_tokenizer(args.tokenizer or EngineConfig().target_path)


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
    """run_online_bench options shared by --target, --base-url, --k8s and --launch."""
    from minedraft.bench.online import Ramp
    from minedraft.bench.records import parse_percentiles, parse_slo

    ramp = args.ramp_up_strategy and Ramp(args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps)
    backend = _bench_backend(args)
    return {
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "ramp": ramp or None,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "ignore_eos": args.ignore_eos,
        "stop": args.stop,
        "seed": args.sampling_seed if args.sampling_seed is not None else _engine_config(args).seed,
        "timeout": args.timeout,
        "warmup": args.warmup,
        "progress": args.progress_interval,
        "backend": backend,
        "model": args.served_model_name,
        "api_key": args.bench_api_key or os.environ.get("OPENAI_API_KEY"),
        # counts the output of an OpenAI server that sends no usage
        "tokenizer": _bench_tokenizer(args) if backend != "minedraft-grpc" else None,
        "percentiles": parse_percentiles(args.percentiles),
        "slo": parse_slo(args.slo),
    }


def _bench_server(args: argparse.Namespace, requests: list) -> int:
    """One run against a running server (or one per --sweep-concurrency value), reported and written out."""
    from minedraft.bench.online import format_result, run_online_bench

    options = _online_kwargs(args)
    sweep = _sweep(args.sweep_concurrency)
    results = {}
    for concurrency in sweep or [args.concurrency]:
        label = f"concurrency {concurrency}" if sweep else ""
        options.update(concurrency=concurrency, label=label)
        results[label] = run_online_bench(args.base_url or args.target, requests, metrics_url=args.metrics_url,
                                          **options)  # fmt: skip
        print(format_result(results[label]), flush=True)
    _write_bench_outputs(args, results, sweep=bool(sweep))
    return 0 if not any(r.failed for r in results.values()) else 1


def _sweep(text: str | None) -> list[int]:
    """--sweep-concurrency 1,4,16 -> [1, 4, 16]; [] when not given."""
    if not text:
        return []
    try:
        values = [int(c) for c in text.split(",")]
    except ValueError:
        values = []
    if not values or any(c < 1 for c in values):
        raise ValueError(f"--sweep-concurrency wants integers >= 1 like 1,4,16, got {text!r}")
    return values


def _write_bench_outputs(args: argparse.Namespace, results: dict, sweep: bool = False) -> None:
    """--json (one run: its object; several: keyed by name), --trace, --plot."""
    from minedraft.bench.report import plot, to_json, write_trace

    if args.json:
        single = len(results) == 1 and not sweep and not args.launch
        Path(args.json).write_text(to_json(next(iter(results.values())) if single else results) + "\n",
                                   encoding="utf-8")  # fmt: skip
    if args.trace:
        write_trace(results, args.trace)
    if args.plot:
        plot(results, args.plot, sweep=sweep)


def _bench_k8s(args: argparse.Namespace, requests: list) -> int:
    """The --target benchmark through a port-forward to the release's public Service, closed afterwards."""
    from minedraft.bench.k8s import SCHEDULER_PORT, port_forward

    with port_forward(args.service, args.namespace, method=args.port_forward) as target:
        print(f"forwarding {target} -> svc/{args.service}:{SCHEDULER_PORT} in namespace {args.namespace}", flush=True)
        args.target = target
        return _bench_server(args, requests)


def _bench_launch(args: argparse.Namespace, requests: list) -> int:
    import tempfile

    from minedraft.bench.launch import format_comparison, greedy_mismatches, run_launch_bench

    engine, speculative = _bench_engines(args)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="minedraft-bench-"))
    modes = (args.modes or LAUNCH_MODES).split(",")
    try:
        results = run_launch_bench(
            modes, speculative, engine, requests, log_dir=log_dir, log_level=args.log_level,
            repeats=args.repeats, **_online_kwargs(args),
        )  # fmt: skip
    except (RuntimeError, TimeoutError, ConnectionError) as exc:
        raise RuntimeError(f"{exc} (service logs: {log_dir})") from exc
    print(format_comparison(results))
    if args.temperature == 0:
        for mode, count in greedy_mismatches(results).items():
            if count:
                print(f"warning: {count} greedy outputs of {mode} differ from {modes[0]}'s", flush=True)
    _write_bench_outputs(args, results)
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
               "worker": _settings(args, WorkerSettings, aliases=False), "log_dir": _up_log_dir(args)}  # fmt: skip
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


def _up_log_dir(args: argparse.Namespace) -> Path | None:
    log_dir = _settings(args, SupervisorSettings).log_dir
    if log_dir is None:
        return None
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return Path(log_dir)


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
        # Until a signal, or a service that crash-loops: a service that exits is started again.
        return Supervisor(stack, _settings(args, SupervisorSettings)).run()


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
        help="benchmark: the engine in this process (--offline), a running server over gRPC (--target) or "
        "OpenAI's HTTP API (--base-url), local stacks started mode by mode (--launch); `bench compare A B`",
        description="Ways to benchmark. --offline: the engine in this process, mode by mode (tokens/s, "
        "accepted length). --target HOST:PORT (MineDraft gRPC) or --base-url URL with --backend openai|openai-chat "
        "(any OpenAI-compatible server: minedraft up --http-port, vllm serve, ...): streamed requests against a "
        "running server, measured at the client with vLLM's definitions (TTFT, TPOT, ITL per chunk, E2EL, "
        "token throughputs, goodput). --launch: for each of --modes, start verifier, drafter and "
        "scheduler locally (the engine flags apply), run the --target benchmark on it, stop it; then one "
        "side-by-side table. With --offline and --launch, --speculative-config gives the keys the speculative modes "
        "share (k, draft model, Tetris knobs); each mode sets is_parallel, force_pearl and tetris itself. "
        "`minedraft bench compare A.json B.json` tables two --json results (ours or vllm bench serve's). "
        "See benchmarks/README.md.",
    )
    how = bench.add_mutually_exclusive_group()  # one is required, or the `compare` subcommand: cmd_bench checks
    how.add_argument("--offline", action="store_true", help="run the engine in this process, mode by mode")
    how.add_argument("--target", metavar="HOST:PORT", help="benchmark the MineDraft gRPC server at this address")
    how.add_argument(
        "--base-url", metavar="URL", help="benchmark the OpenAI-compatible server at this URL (http://HOST:PORT)"
    )
    how.add_argument("--launch", action="store_true", help="start a local stack per mode and benchmark each")
    how.add_argument(
        "--k8s", action="store_true", help="benchmark a release in Kubernetes through a port-forward to its gateway"
    )
    bench.add_argument(
        "--backend", choices=("minedraft-grpc", "openai", "openai-chat"), default=None,
        help="how to talk to the server: minedraft-grpc (default with --target, --launch, --k8s), openai "
        "(/v1/completions, default with --base-url) or openai-chat (/v1/chat/completions)",
    )  # fmt: skip
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
        f"PARD draft; +eagle3: the EAGLE-3 head; +p-eagle: the head drafting in one pass); default: {OFFLINE_MODES} "
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
    data = bench.add_argument_group("dataset")
    data.add_argument(
        "--dataset", default=None, help="prompts: 'random' (random tokens of --input-len), a .jsonl of {prompt} or a "
        "ShareGPT .json; default: the bundled held-out code prompts",
    )  # fmt: skip
    data.add_argument("--num-prompts", type=int, default=64, help="use the first N prompts of the dataset")
    data.add_argument("--input-len", "--random-input-len", type=int, default=128, help="random: prompt tokens")
    data.add_argument(
        "--output-len", "--random-output-len", type=int, default=None,
        help="random: tokens asked of each request (its max_tokens; add --ignore-eos to get them all); "
        "default: --max-tokens",
    )  # fmt: skip
    data.add_argument(
        "--random-range-ratio", type=float, default=0.0,
        help="random: lengths drawn uniformly from [len * (1 - r), len * (1 + r)]",
    )  # fmt: skip
    data.add_argument(
        "--tokenizer", default=None, help="folder (or hub id) of the tokenizer.json that makes random prompts and "
        "counts the output of an OpenAI server that reports no usage; default: the bundled target's",
    )  # fmt: skip
    online = bench.add_argument_group("online (--target, --base-url, --launch, --k8s)")
    online.add_argument(
        "--concurrency", "--max-concurrency", type=int, default=16, help="most requests in flight at once"
    )
    online.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests per second, arriving as a gamma process of shape --burstiness (still capped by "
        "--concurrency); default: send as fast as the concurrency allows",
    )
    online.add_argument(
        "--burstiness", type=float, default=1.0, help="shape of the arrival gaps' gamma distribution: 1 = Poisson, "
        "below 1 burstier, above 1 more even",
    )  # fmt: skip
    online.add_argument("--ramp-up-strategy", choices=("linear", "exponential"), default=None,
                        help="let the request rate move from --ramp-up-start-rps to --ramp-up-end-rps over the run")
    online.add_argument("--ramp-up-start-rps", type=float, default=None, help="ramp-up: the first rate (req/s)")
    online.add_argument("--ramp-up-end-rps", type=float, default=None, help="ramp-up: the last rate (req/s)")
    online.add_argument(
        "--sweep-concurrency", metavar="C1,C2,...", default=None,
        help="--target / --base-url: one run per concurrency (e.g. 1,4,16,32,64); --plot adds tok/s and TTFT "
        "against concurrency",
    )  # fmt: skip
    online.add_argument("--timeout", type=float, default=600.0, help="per-request deadline in seconds")
    online.add_argument(
        "--progress-interval", type=float, default=5.0, help="seconds between progress lines when stdout is not a "
        "terminal (on a terminal: a progress bar)",
    )  # fmt: skip
    online.add_argument(
        "--warmup", type=int, default=2, help="requests sent (and not measured) before the run, per server"
    )
    online.add_argument(
        "--served-model-name", default=None, help="OpenAI backends: the model to ask for; default: the first one "
        "the server's /v1/models lists",
    )  # fmt: skip
    online.add_argument(
        "--api-key", dest="bench_api_key", metavar="KEY", default=None, help="OpenAI backends: bearer token; default: "
        "$OPENAI_API_KEY",
    )  # fmt: skip
    online.add_argument(
        "--percentiles", "--metric-percentiles", default="99",
        help="comma-separated percentiles of TTFT, TPOT, ITL and E2EL to report, e.g. 50,90,99",
    )  # fmt: skip
    online.add_argument(
        "--slo", "--goodput", nargs="+", default=None, metavar="KEY:MS",
        help="limits for goodput (requests per second meeting all of them), e.g. ttft:200,tpot:50; keys ttft, "
        "tpot, e2el, in milliseconds",
    )  # fmt: skip
    online.add_argument(
        "--metrics-url",
        default=None,
        help="--target / --base-url: a MineDraft scheduler's Prometheus endpoint (e.g. "
        "http://127.0.0.1:7450/metrics), scraped before and after the run for step times, overhead and overlap",
    )
    online.add_argument(
        "--json", metavar="FILE", default=None, help="also write the figures as JSON (vLLM's keys: mean_ttft_ms, ...)"
    )
    online.add_argument(
        "--trace", metavar="FILE.jsonl", default=None, help="write one line per request: when it was sent, TTFT, "
        "E2EL, every chunk's time and tokens, accepted drafts",
    )  # fmt: skip
    online.add_argument(
        "--plot", metavar="FILE.png", default=None,
        help="draw throughput, latency percentiles and acceptance per draft position (needs matplotlib: the "
        "`bench` extra)",
    )  # fmt: skip
    online.add_argument(
        "--draft-model", default=None, help="--launch: draft checkpoint of the speculative modes; default: bundled"
    )
    online.add_argument("--log-dir", default=None, help="--launch: service logs; default: a new temporary folder")
    online.add_argument("--log-level", default="INFO", help="--launch: the services' log level")
    chaos = bench.add_argument_group("chaos (--chaos --target HOST:PORT of a `minedraft up` on this machine)")
    chaos.add_argument(
        "--chaos", action="store_true", help="SIGKILL the services of the `minedraft up` serving --target, one at a "
        "time, under greedy load through the client SDK (retries and resumption on); report requests lost, "
        "outputs changed against an undisturbed first pass, and time to heal",
    )  # fmt: skip
    chaos.add_argument("--chaos-interval", type=float, default=20.0, help="seconds between kills")
    chaos.add_argument("--chaos-duration", type=float, default=60.0, help="seconds of the chaos pass")
    chaos.add_argument(
        "--chaos-targets", default=",".join(CHAOS_ROLES), help="the roles killed in turn (each group's in turn)"
    )
    _add_engine_args(bench)
    _add_sampling_args(bench, temperature=0.0, max_tokens=64)
    bench.set_defaults(func=cmd_bench)
    bench_sub = bench.add_subparsers(dest="bench_command", required=False, metavar="compare")
    compare = bench_sub.add_parser(
        "compare", help="a table of two --json results' figures, their differences and ratios",
        description="Compare two result files of `minedraft bench --json` (or `vllm bench serve --save-result`): "
        "every figure both have, with B - A and B / A. Files holding several runs (--launch, --sweep-concurrency) "
        "are compared run by run.",
    )  # fmt: skip
    compare.add_argument("a", metavar="A.json")
    compare.add_argument("b", metavar="B.json")
    compare.set_defaults(func=cmd_bench_compare)

    up = sub.add_parser(
        "up",
        help="start verifier, drafter and scheduler as local processes (the embedded default)",
        description="Start the whole stack on this machine with the bundled models, in MineDraft mode unless "
        "--speculative-config says otherwise ('null' = plain autoregressive decoding). A service that exits is "
        "started again (with back-off); only one that crash-loops, or a signal, stops the stack.",
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
    _add_settings_args(up, SupervisorSettings, "supervision (a service that exits is started again)")
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
