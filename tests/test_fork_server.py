"""The fork server (stack/fork_server.py): services forked from a warm process are real processes that answer
signals, report their exit status, serve as fresh ones do, and die with the process that forked them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from minedraft.client import Client
from minedraft.stack import fork_server
from minedraft.stack.fork_server import ForkedProcess, enable, launch_service
from minedraft.stack.local import LocalStack, child_env

from conftest import tiny_config
from services import wait_serving

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux's")

MINEDRAFT = [sys.executable, "-m", "minedraft"]


@pytest.fixture(autouse=True)
def forking(monkeypatch) -> None:
    """On here whatever the suite's setting (tests/conftest.py), with fork servers of these tests' own."""
    for name, value in (("_SERVERS", {}), ("_enabled", True), ("_ignored", frozenset())):
        monkeypatch.setattr(fork_server, name, value)


def test_a_forked_service_fails_with_the_code_and_message_of_a_fresh_one(tmp_path: Path) -> None:
    env = child_env(dict(os.environ))
    ended = {}
    for forkable in (True, False):
        log = tmp_path / f"forkable-{forkable}.log"
        process = launch_service([*MINEDRAFT, "scheduler", "--no-such-flag"], env, log, forkable=forkable)
        assert isinstance(process, ForkedProcess if forkable else subprocess.Popen)
        ended[forkable] = process.wait(timeout=60), log.read_text().splitlines()[-1]
    assert ended[True] == ended[False]
    assert ended[True][0] == 2 and "unrecognized arguments: --no-such-flag" in ended[True][1]


def test_a_log_that_cannot_be_opened_fails_in_the_launcher_forked_or_fresh(tmp_path: Path) -> None:
    for forkable in (True, False):
        with pytest.raises(FileNotFoundError):
            launch_service([*MINEDRAFT, "scheduler", "--help"], child_env(dict(os.environ)),
                           tmp_path / "missing" / "scheduler.log", forkable=forkable)  # fmt: skip


def test_fresh_interpreters_where_the_fork_server_is_off(tmp_path: Path) -> None:
    enable(False)
    process = launch_service([*MINEDRAFT, "scheduler", "--help"], child_env(dict(os.environ)), tmp_path / "log",
                             forkable=True)  # fmt: skip
    assert isinstance(process, subprocess.Popen) and process.wait(timeout=60) == 0


def test_a_forked_service_takes_its_environment_threads_log_and_session(tmp_path: Path) -> None:
    """What a fresh interpreter would take from its start: checked in a process that plays the forked child."""
    log = tmp_path / "service.log"
    request = {"args": ["verifier"], "env": {"OMP_NUM_THREADS": "1", "ONLY_HERE": "yes"}, "log": str(log)}
    script = (
        "import json, os, sys, torch; from minedraft.stack.fork_server import _become_service; "
        f"args = _become_service(json.loads({json.dumps(json.dumps(request))}), 2); "
        "print(json.dumps([args, sys.argv[1:], torch.get_num_threads(), os.environ.get('ONLY_HERE'), "
        "os.environ.get('HOME'), os.getsid(0) == os.getpid()]), flush=True)"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, env={**os.environ, "HOME": "/nowhere"})
    assert json.loads(log.read_text()) == [["verifier"], ["verifier"], 1, "yes", None, True]


def test_signals_reach_forked_services_and_their_status_comes_back(pair, tmp_path: Path) -> None:
    with LocalStack(tiny_config(pair), log_dir=tmp_path) as stack:
        verifier = stack.process("verifier")
        assert isinstance(verifier, ForkedProcess) and verifier.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            verifier.wait(timeout=0.2)
        verifier.kill()
        assert verifier.wait(timeout=60) == -signal.SIGKILL and verifier.poll() == -signal.SIGKILL
        verifier.kill()  # a no-op once it has exited: the pid may belong to another process by now
        stack.restart("verifier")
        wait_serving(stack.verifier_address, timeout_s=120)
        with Client(stack.address) as client:
            assert len(client.generate([1, 2, 3], max_tokens=8, temperature=0).token_ids) == 8
        scheduler = stack.process("scheduler")
    assert scheduler.returncode == 0  # SIGTERM: the scheduler drained and exited in order


def test_services_die_with_their_fork_server_and_the_next_start_takes_a_new_one(pair, tmp_path: Path) -> None:
    with LocalStack(tiny_config(pair), log_dir=tmp_path) as stack:
        verifier = stack.process("verifier")
        server = verifier._server
        server.process.kill()
        assert verifier.wait(timeout=60) == -signal.SIGTERM  # its death signal; nobody is left to report more
        assert stack.process("scheduler").wait(timeout=60) == -signal.SIGTERM
        for name in ("verifier", "scheduler"):
            stack.restart(name)
        assert stack.process("verifier")._server is not server
        wait_serving(stack.address, timeout_s=120)


def test_services_share_a_fork_server_where_their_start_time_environments_agree() -> None:
    env = child_env(dict(os.environ))
    one = fork_server._server_for({**env, "OMP_NUM_THREADS": "1", fork_server.API_KEYS_ENV: "a"})
    assert fork_server._server_for({**env, "OMP_NUM_THREADS": "2"}) is one  # applied as each service starts
    assert fork_server._server_for({**env, "GOMP_SPINCOUNT": "7"}) is not one  # read by OpenMP as torch loads
    assert fork_server._server_for({**env, "CURRENT_TEST": "b"}) is not one
    enable(run_time_variables=("CURRENT_TEST",))  # the launcher's own, changing as it runs (a test runner's)
    assert fork_server._server_for({**env, "CURRENT_TEST": "b"}) is one
