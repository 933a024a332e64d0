"""Flags generated from pydantic models, in this process (no subprocess, no model loaded): `bench`'s bounds as
one line naming the flag, and one environment rule for every flag that reads a MINEDRAFT_* variable."""

from __future__ import annotations

import argparse
import os

import pytest

from minedraft.cli import build_parser, main
from minedraft.cli.bench import bench_options
from minedraft.cli.bench_options import BenchOptions
from minedraft.cli.common import listen_settings
from minedraft.cli.flags import FlagError, flag_name, model_from_args
from minedraft.cli.serve import GatewayBackends, dist_config
from minedraft.config import EngineConfig


@pytest.fixture(autouse=True)
def _no_minedraft_variables(monkeypatch) -> None:
    for key in [k for k in os.environ if k.startswith("MINEDRAFT_")]:
        monkeypatch.delenv(key)


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--offline", "--repeats", "0"], "--repeats: Input should be greater than or equal to 1, got 0"),
        (["--offline", "--random-range-ratio", "1"], "--random-range-ratio: Input should be less than 1, got 1.0"),
        (["--target", "h:1", "--max-concurrency", "0"], "--concurrency: Input should be greater than or equal to 1"),
        (["--target", "h:1", "--temperature", "-1"], "--temperature: Input should be greater than or equal to 0"),
        (["--target", "localhost"], "--target: must be host:port, got 'localhost'"),
        (["--base-url", "ftp://h"], "--base-url: must be an http:// or https:// URL, got 'ftp://h'"),
        (["--target", "h:1", "--sweep-concurrency", "4,0"], "--sweep-concurrency: wants integers >= 1 like 1,4,16"),
        (["--target", "h:1", "--ramp-up-strategy", "linear"], "--ramp-up-strategy goes with --ramp-up-start-rps"),
        ([], "give one of --offline, --target, --base-url, --launch, --k8s"),
    ],
)  # fmt: skip
def test_a_bad_bench_flag_is_one_line_naming_it(argv: list[str], line: str, capsys) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"minedraft bench: {line}"), err


def test_bench_flags_are_the_options_fields() -> None:
    """Every BenchOptions field is a bench flag, and every bench flag but the engine's is a field."""
    parser = _subparser("bench")
    dests = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(BenchOptions.model_fields) <= dests
    assert dests - set(BenchOptions.model_fields) == set(EngineConfig.model_fields) | {"engine_config"}
    options = {s for a in parser._actions for s in a.option_strings}
    assert {flag_name(n, f) for n, f in BenchOptions.model_fields.items()} <= options


def test_bench_defaults_are_the_models() -> None:
    parsed = build_parser().parse_args(["bench", "--offline"])
    assert bench_options(parsed) == BenchOptions(offline=True, temperature=0.0, max_tokens=64)
    assert parsed.service == "minedraft-gateway" and parsed.port_forward == "kubectl"


def test_bench_rules_raise_flag_errors() -> None:
    with pytest.raises(FlagError, match="--draft-model goes with --launch"):
        bench_options(build_parser().parse_args(["bench", "--offline", "--draft-model", "d"]))


def test_listen_and_dist_variables_are_read_when_the_command_runs(monkeypatch) -> None:
    args = build_parser().parse_args(["verifier", "--dist-addr", "10.0.0.1"])
    monkeypatch.setenv("MINEDRAFT_PORT", "7000")  # set after parsing: still read
    monkeypatch.setenv("MINEDRAFT_HOST", "")  # empty: unset
    monkeypatch.setenv("MINEDRAFT_DIST_ADDR", "10.0.0.2")  # the flag wins
    monkeypatch.setenv("MINEDRAFT_DIST_PORT", "1234")
    listen = listen_settings(args)
    assert (listen.host, listen.port, listen.log_level) == ("0.0.0.0", 7000, "INFO")
    dist = dist_config(args)
    assert (dist.master_addr, dist.master_port, dist.backend, dist.store_host) == ("10.0.0.1", 1234, "auto", "0.0.0.0")


@pytest.mark.parametrize(
    ("command", "defaults"),
    [("up", ("127.0.0.1", 50051)), ("gateway", ("0.0.0.0", 50050)), ("scheduler", ("0.0.0.0", 50051)),
     ("verifier", ("0.0.0.0", 50061)), ("drafter", ("0.0.0.0", 50062))],
)  # fmt: skip
def test_each_command_listens_where_it_did(command: str, defaults: tuple[str, int]) -> None:
    listen = listen_settings(build_parser().parse_args([command]))
    assert (listen.host, listen.port) == defaults


def test_a_bad_variable_is_one_line_naming_its_flag(monkeypatch) -> None:
    monkeypatch.setenv("MINEDRAFT_DIST_PORT", "0")
    with pytest.raises(FlagError, match="--dist-port: Input should be greater than or equal to 1, got '0'"):
        dist_config(build_parser().parse_args(["drafter"]))


def test_gateway_backends_from_the_variable_or_the_flags(monkeypatch) -> None:
    monkeypatch.setenv("MINEDRAFT_BACKEND", "h:1, h:2@9000")
    assert model_from_args(build_parser().parse_args(["gateway"]), GatewayBackends).backend == ["h:1", "h:2@9000"]
    flags = build_parser().parse_args(["gateway", "--backend", "a:1", "--backend", "b:2"])
    assert model_from_args(flags, GatewayBackends).backend == ["a:1", "b:2"]  # the flags win
    with pytest.raises(FlagError, match="--backend: a backend is HOST:PORT"):
        model_from_args(build_parser().parse_args(["gateway", "--backend", "nohost"]), GatewayBackends)
