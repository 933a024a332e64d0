"""Service settings reach every process they concern, as `minedraft up` starts them (one engine group, and N
behind a gateway): each child's command line, parsed by the real CLI, gives the settings the user asked for.

Every field is set off its default, so a dropped one shows.
"""

from __future__ import annotations

import os

import pytest

from minedraft.cli import build_parser
from minedraft.cli.common import settings
from minedraft.cli.serve import up_stack
from minedraft.frontends.auth import API_KEYS_ENV
from minedraft.settings import (
    BACKEND_API_KEY_ENV,
    GatewaySettings,
    PublicApiSettings,
    SchedulerSettings,
    ServiceSettings,
    SupervisorSettings,
    WorkerSettings,
)
from minedraft.stack.local import child_env

SCHEDULER = SchedulerSettings(
    http_port=8123, served_model_name="tiny", tls_cert="cert.pem", tls_key="key.pem", max_prompt_bytes=4096,
    max_waiting_requests=7, metrics_port=9300, startup_timeout=77.0, worker_wait=11.0, join_timeout=12.0,
    request_drain_timeout=5.0, step_deadline_floor=13.0, max_steps_in_flight=1, log_stats_interval=3.0,
    per_request_spec_decode_metrics="detailed", seeded_drafter_wait=7.0,
)  # fmt: skip
# `up --engine-groups N`: the gateway is the public edge (HTTP port, TLS); the groups serve gRPC to it alone
GROUPS_SCHEDULER = SCHEDULER.model_copy(update={"http_port": 0, "tls_cert": None, "tls_key": None})
WORKER = WorkerSettings(dist_timeout=9.0, step_drain_timeout=4.0, cpu_threads_beside=3, colocate_drafter=True)
PUBLIC = {name: getattr(SCHEDULER, name) for name in PublicApiSettings.model_fields}  # up's flags for both
GATEWAY = GatewaySettings(placement_timeout=3.0, backend_tls_ca="ca.pem", backend_tls_server_name="groups",
                          routing_policy="predicted", **PUBLIC)  # fmt: skip


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch) -> None:
    for key in [k for k in os.environ if k.startswith("MINEDRAFT_")]:
        monkeypatch.delenv(key)


def _off_default(settings: ServiceSettings, *exempt: str) -> ServiceSettings:
    fields = type(settings).model_fields
    on_default = [n for n, f in fields.items() if getattr(settings, n) == f.default and n not in exempt]
    assert on_default == [], "set every field off its default"
    return settings


def _flags(settings: ServiceSettings) -> list[str]:
    """The settings as a user types them: one flag per field."""
    flags = []
    for name, value in settings.model_dump(exclude_defaults=True).items():
        flag = "--" + name.replace("_", "-")
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return flags


def _up(*argv: str):
    return up_stack(build_parser().parse_args(["up", *argv]))


def _child(argv: list[str], model: type[ServiceSettings]) -> ServiceSettings:
    """What a child process started with `argv` runs with."""
    return settings(build_parser().parse_args(argv), model)


@pytest.fixture
def tls_files(tmp_path, monkeypatch) -> None:
    """The settings name cert.pem and key.pem: `up` reads them before it starts anything."""
    monkeypatch.chdir(tmp_path)
    for name in ("cert.pem", "key.pem"):
        (tmp_path / name).write_text("not checked here")


@pytest.mark.usefixtures("tls_files")
def test_every_service_setting_reaches_every_process_of_up() -> None:
    scheduler, worker = _off_default(SCHEDULER), _off_default(WORKER)
    stack = _up(*_flags(scheduler), *_flags(worker), "--api-key", "secret-1")
    commands = stack.commands
    assert _child(commands["scheduler"], SchedulerSettings) == scheduler
    assert "drafter" not in commands  # colocate_drafter: the verifier drafts, no drafter service runs
    assert _child(commands["verifier"], WorkerSettings) == worker
    assert commands["scheduler"][commands["scheduler"].index("--drafter") + 1] == ""
    assert stack._scheduler_env({})[API_KEYS_ENV] == "secret-1"  # the keys: in its environment
    assert all("secret-1" not in arg for args in commands.values() for arg in args)
    assert stack.drain_timeout_s == scheduler.request_drain_timeout  # how long `up` waits for it on stop


@pytest.mark.usefixtures("tls_files")
def test_every_service_setting_reaches_every_process_of_up_with_engine_groups() -> None:
    scheduler, worker = _off_default(SCHEDULER), _off_default(WORKER)
    gateway = _off_default(GATEWAY, "backend_tls_ca", "backend_tls_server_name")  # up's groups serve plaintext
    gateway = gateway.model_copy(update={"backend_tls_ca": None, "backend_tls_server_name": None})
    stack = _up("--engine-groups", "3", *_flags(scheduler), *_flags(worker), "--placement-timeout", "3",
                "--routing-policy", "predicted", "--api-key", "secret-1")  # fmt: skip
    assert len(stack.groups) == 3
    for i, group in enumerate(stack.groups):
        expected = GROUPS_SCHEDULER.model_copy(update={"metrics_port": scheduler.metrics_port + i})
        assert _child(group.commands["scheduler"], SchedulerSettings) == expected
        assert "drafter" not in group.commands
        assert _child(group.commands["verifier"], WorkerSettings) == worker
    command = stack.gateway_command()
    assert command[1:3] == ["-m", "minedraft"]
    assert _child(command[3:], GatewaySettings) == gateway
    # the gateway checks the clients' key; the groups take only the gateway's own, made for this stack
    env = stack.gateway_env({})
    assert env[API_KEYS_ENV] == "secret-1"
    assert {group._scheduler_env({})[API_KEYS_ENV] for group in stack.groups} == {env[BACKEND_API_KEY_ENV]}
    assert env[BACKEND_API_KEY_ENV] != "secret-1"
    commands = [command] + [args for group in stack.groups for args in group.commands.values()]
    assert all(secret not in arg for args in commands for arg in args for secret in env.values())


def test_up_with_engine_groups_gives_the_schedulers_the_drain_timeout(capsys) -> None:
    """`up --engine-groups 2 --drain-timeout 5` (the old spelling) used to run its schedulers with 30 s."""
    stack = _up("--engine-groups", "2", "--drain-timeout", "5")
    for group in stack.groups:
        assert _child(group.commands["scheduler"], SchedulerSettings).request_drain_timeout == 5
        assert group.drain_timeout_s == 5
    assert "--drain-timeout is deprecated, use --request-drain-timeout" in capsys.readouterr().err


def test_up_with_engine_groups_refuses_tls_toward_its_plaintext_groups() -> None:
    with pytest.raises(ValueError, match="--backend-tls-ca"):
        _up("--engine-groups", "2", "--backend-tls-ca", "ca.pem")


@pytest.mark.parametrize(
    ("command", "model", "field"),
    [("scheduler", SchedulerSettings, "request_drain_timeout"), ("verifier", WorkerSettings, "step_drain_timeout"),
     ("drafter", WorkerSettings, "step_drain_timeout")],
)  # fmt: skip
def test_the_old_drain_timeout_spelling_still_works(command, model, field, monkeypatch, capsys) -> None:
    assert getattr(_child([command, "--drain-timeout", "7"], model), field) == 7
    monkeypatch.setenv("MINEDRAFT_DRAIN_TIMEOUT", "8")
    assert getattr(_child([command], model), field) == 8
    new = "--" + field.replace("_", "-")
    assert getattr(_child([command, new, "9"], model), field) == 9  # the new name wins
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    assert f"deprecated alias of {new}" in " ".join(capsys.readouterr().out.split())


def test_flags_override_the_json_and_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("MINEDRAFT_SCHEDULER_SETTINGS", SCHEDULER.model_dump_json())
    monkeypatch.setenv("MINEDRAFT_WORKER_WAIT", "21")
    settings = _child(["scheduler", "--join-timeout", "22"], SchedulerSettings)
    assert settings == SCHEDULER.model_copy(update={"worker_wait": 21.0, "join_timeout": 22.0})


def test_children_do_not_inherit_setting_variables() -> None:
    """A child gets its settings whole; the launcher's MINEDRAFT_METRICS_PORT would override group i's port."""
    env = {"MINEDRAFT_METRICS_PORT": "7450", "MINEDRAFT_DRAIN_TIMEOUT": "1", "MINEDRAFT_MAX_NUM_SEQS": "2",
           API_KEYS_ENV: "k", "PATH": "/bin"}  # fmt: skip
    assert child_env(env) == {API_KEYS_ENV: "k", "PATH": "/bin"}


def test_bad_settings_fail_with_the_field_name() -> None:
    with pytest.raises(ValueError, match="max_waiting_requests"):
        _child(["scheduler", "--max-waiting-requests", "-1"], SchedulerSettings)
    with pytest.raises(ValueError, match="TLS needs both"):
        _child(["scheduler", "--tls-cert", "cert.pem"], SchedulerSettings)


def test_up_reads_its_supervision_settings_and_logs_where_they_say(tmp_path) -> None:
    """The supervision settings are `up`'s own (no child gets them); --log-dir places every service's log."""
    supervisor = _off_default(SupervisorSettings(restart_backoff_max=3.0, crash_loop_restarts=2,
                                                 crash_loop_window=30.0, log_dir=str(tmp_path)))  # fmt: skip
    argv = ["up", *_flags(supervisor)]
    assert settings(build_parser().parse_args(argv), SupervisorSettings) == supervisor
    assert _up(*argv[1:]).log_path("drafter") == tmp_path / "drafter.log"
    stack = _up("--engine-groups", "2", *argv[1:])
    assert stack.log_path("group 1 verifier") == tmp_path / "group-1" / "verifier.log"
    assert stack.log_path("gateway") == tmp_path / "gateway.log"
    assert [name for name, _ in stack.processes()] == []  # nothing started yet
