"""The command line as a user runs it: real subprocesses, the bundled models."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from minedraft import LLM, SamplingParams
from minedraft.config import BUNDLED_DRAFT, BUNDLED_TARGET
from minedraft.stack.local import free_port

from conftest import require_weights


@pytest.fixture(autouse=True, scope="module")
def _committed_weights() -> None:
    require_weights(BUNDLED_TARGET, BUNDLED_DRAFT)


def _minedraft(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minedraft", *args], capture_output=True, text=True, timeout=300)


def test_generate_json_equals_the_offline_api() -> None:
    result = _minedraft(
        "generate", "--prompt", "def read_config(path):", "--temperature", "0", "--max-tokens", "12", "--json",
        "--speculative-config", '{"num_speculative_tokens": 3, "is_parallel": true}', "--device", "cpu",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    with LLM(device="cpu") as llm:
        expected = llm.generate("def read_config(path):", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert record["token_ids"] == expected[0].outputs[0].token_ids
    assert record["text"] == expected[0].outputs[0].text
    assert record["spec_decode_stats"]["num_drafts"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["generate", "--prompt", "x", "--speculative-config", '{"bogus": 1}'], "bogus"),
        (
            ["generate", "--prompt", "x", "--speculative-config", '{"num_speculative_tokens": 0}'],
            "num_speculative_tokens",
        ),
        (["generate", "--prompt", "x", "--model", "/nonexistent/checkpoint"], "/nonexistent/checkpoint"),
        (["bench", "--offline", "--repeats", "0"], "--repeats"),
        (["bench", "--offline", "--k", "3", "--speculative-config", '{"num_speculative_tokens": 4}'], "contradicts"),
        (["bench", "--target", "127.0.0.1:1", "--speculative-config", '{"num_speculative_tokens": 4}'], "engine flags"),
        (["bench", "--chaos", "--k8s"], "--chaos needs --target HOST:PORT"),
        (["bench", "--chaos", "--offline"], "--chaos needs --target HOST:PORT"),
        (["bench", "--chaos", "--target", "127.0.0.1:1", "--chaos-targets", "drafter,router"], "--chaos-targets"),
        (["bench", "--chaos", "--target", "127.0.0.1:1", "--chaos-interval", "0"], "--chaos-interval"),
        (["up", "--engine-config", "{not json"], "--engine-config is not valid JSON"),
        (["up", "--engine-config", '{"max_num_seqs": 0}'], "max_num_seqs"),
    ],
)
def test_bad_flags_fail_with_a_message(args: list[str], message: str) -> None:
    result = _minedraft(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_chaos_without_a_local_up_on_the_target_port_is_one_line() -> None:
    port = free_port()
    result = _minedraft("bench", "--chaos", "--target", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert result.stderr == (f"minedraft bench: no `minedraft up --port {port}` runs on this machine: --chaos kills "
                             "the services of a local `minedraft up`, given as --target 127.0.0.1:PORT\n")  # fmt: skip


def test_plot_without_matplotlib_names_the_extra_before_any_work(tmp_path) -> None:
    """matplotlib not importable (as if not installed): `bench --launch --plot` says in one line which extra to
    install, and exits before it launches a stack or writes a file."""
    hidden = ("import sys; sys.modules['matplotlib'] = None  # as if not installed\n"
              "from minedraft.cli import main; sys.exit(main(sys.argv[1:]))")
    args = ["bench", "--launch", "--log-dir", str(tmp_path / "logs"), "--plot", str(tmp_path / "run.png")]
    result = subprocess.run([sys.executable, "-c", hidden, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == "minedraft bench: --plot needs matplotlib: pip install 'minedraft[bench]'\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["scheduler", "--model", "/nonexistent/checkpoint"], "--model /nonexistent/checkpoint: no such folder"),
        (["up", "--speculative-config", '{"model": "/nonexistent/draft"}'],
         "--speculative-config's model /nonexistent/draft: no such folder"),
        (["scheduler", "--api-key-file", "/nonexistent/keys"], "cannot read --api-key-file /nonexistent/keys"),
        (["up", "--api-key-file", "/nonexistent/keys"], "cannot read --api-key-file /nonexistent/keys"),
        (["gateway", "--api-key-file", "/nonexistent/keys"], "cannot read --api-key-file /nonexistent/keys"),
        (["gateway", "--backend-api-key-file", "/nonexistent/key"], "cannot read --backend-api-key-file"),
        (["gateway", "--tls-cert", "/nonexistent/cert", "--tls-key", "/nonexistent/key"],
         "cannot read --tls-cert /nonexistent/cert"),
        (["gateway", "--backend-tls-ca", "/nonexistent/ca"], "cannot read --backend-tls-ca /nonexistent/ca"),
        (["gateway", "--tokenizer", "/nonexistent/target"], "--tokenizer /nonexistent/target: no such folder"),
    ],
)  # fmt: skip
def test_a_missing_file_is_one_line_naming_the_flag(args: list[str], message: str) -> None:
    """Before anything starts: exit code 2, one line on stderr, no traceback."""
    extra = {"scheduler": ["--verifier", "127.0.0.1:1"], "gateway": ["--backend", "127.0.0.1:1"], "up": []}
    result = _minedraft(*args, *extra[args[0]], "--port", "0")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"minedraft {args[0]}: "), result.stderr
    assert message in lines[0]


@pytest.mark.parametrize(
    ("service", "flag"),
    [("scheduler", "--port"), ("scheduler", "--metrics-port"), ("scheduler", "--http-port"), ("verifier", "--port"),
     ("gateway", "--port"), ("gateway", "--http-port"), ("up", "--metrics-port")],  # fmt: skip
)
def test_a_taken_port_is_one_line_naming_the_flag(service: str, flag: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        ports = {"--port": "0", "--metrics-port": "0", "--http-port": "0", flag: str(port)}
        if service == "up":  # it waits on its scheduler's port, so that one must be known
            ports["--port"] = str(free_port())
        args = [service, "--host", "127.0.0.1", "--port", ports["--port"]]
        if service == "scheduler":
            args += ["--metrics-port", ports["--metrics-port"], "--http-port", ports["--http-port"],
                     "--verifier", "127.0.0.1:1"]  # fmt: skip
        if service == "up":
            args += ["--metrics-port", ports["--metrics-port"]]
        if service == "gateway":
            args += ["--tokenizer", str(BUNDLED_TARGET), "--backend", "127.0.0.1:1",
                     "--http-port", ports["--http-port"]]  # fmt: skip
        result = _minedraft(*args)
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port} ({flag})" in result.stderr
    assert "Traceback" not in result.stderr
    if service == "up":
        assert "minedraft up: the scheduler exited with code 2 during start-up" in result.stderr


def test_a_service_logging_to_a_file_that_dies_at_start_up_is_reported_with_its_log(tmp_path) -> None:
    """`minedraft bench --launch` and the benchmarks log each service to a file: the error then carries the
    end of that log, where "its error is above" would point at nothing."""
    from minedraft.config import EngineConfig
    from minedraft.settings import StartupError
    from minedraft.stack.local import LocalStack, scheduler_settings

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        stack = LocalStack(EngineConfig(speculative_config=None), scheduler=scheduler_settings(),
                           port=port, log_dir=tmp_path, startup_timeout_s=120)  # fmt: skip
        with pytest.raises(StartupError) as failure:
            stack.start()
    message = str(failure.value)
    assert message.startswith("the scheduler exited with code 2 during start-up; the end of ")
    assert str(tmp_path / "scheduler.log") in message
    assert f"cannot listen on 127.0.0.1:{port} (--port)" in message


def test_offline_bench_prints_every_mode() -> None:
    result = _minedraft(
        "bench", "--offline", "--num-prompts", "2", "--max-tokens", "4", "--repeats", "1", "--modes", "ar,sd,minedraft",
        "--device", "cpu",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    table = result.stdout.splitlines()
    assert [line.split()[0] for line in table if line.split() and line.split()[0] in ("ar", "sd", "minedraft")] == [
        "ar", "sd", "minedraft"
    ]  # fmt: skip
    assert "differs" not in result.stdout


def test_offline_bench_honours_the_speculative_config() -> None:
    """k=1 from --speculative-config: no step can accept more than 1 draft + 1 bonus token (k=4, the
    default, gives about 3.8 on the bundled pair)."""
    result = _minedraft(
        "bench", "--offline", "--num-prompts", "2", "--max-tokens", "16", "--repeats", "1", "--modes", "ar,sd",
        "--device", "cpu", "--speculative-config", '{"num_speculative_tokens": 1, "adaptive": false}',
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    sd = next(line.split() for line in result.stdout.splitlines() if line.startswith("sd "))
    assert 1.0 < float(sd[4]) <= 2.0  # mean accepted length
