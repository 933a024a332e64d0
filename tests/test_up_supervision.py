"""`minedraft up` keeps its stack running as the kubelet keeps pods running: a service SIGKILLed under load is
started again with its unchanged command, the cluster's recovery does the rest, and `up` keeps serving.

Everything goes through `minedraft up` itself, a subprocess; the kills are os.kill(SIGKILL) of the service
processes it started (found by their command lines). Greedy output must equal the offline autoregressive
output (strict kernels) across every kill; a service that fails on every restart stops `up` with one line.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest

from minedraft.client import AsyncClient, Client, RetryPolicy
from minedraft.engine.engine import LLMEngine
from minedraft.sampling.params import SamplingParams
from minedraft.settings import SupervisorSettings
from minedraft.stack.local import free_port
from minedraft.stack.supervision import Supervisor

from conftest import offline_greedy, tiny_config
from services import children, health, serving, worker_info

NUM_STREAMS = 16
MAX_TOKENS = 100
SPEC = {"num_speculative_tokens": 3, "is_parallel": True}  # minedraft
SUPERVISION = ["--restart-backoff-max", "1", "--crash-loop-restarts", "3", "--crash-loop-window", "60"]
# A fault injected through the environment: a drafter started while this file exists exits at once.
FAULT = """import os, pathlib
args = pathlib.Path("/proc/self/cmdline").read_bytes().split(b"\\0")
marker = os.environ.get("MINEDRAFT_TEST_FAULT_FILE")
if marker and os.path.exists(marker) and b"minedraft" in args and args[args.index(b"minedraft") + 1] == b"drafter":
    os._exit(3)
"""


PAIR_SEED = 4  # conftest's `pair` from this seed


def _prompts() -> list[list[int]]:
    return [[(13 * i + j) % 300 + 1 for j in range(1 + i % 4)] for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def expected(pair) -> list[list[int]]:
    return offline_greedy(tiny_config(pair, None, max_num_seqs=16), _prompts(), MAX_TOKENS)


class Up:
    """A running `minedraft up`: its address, its stderr (a file) and its services, found by command line."""

    def __init__(self, pair, tmp: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.port, self.log_dir, self.stderr = free_port(), tmp / "logs", tmp / "up.stderr"
        self.address = f"127.0.0.1:{self.port}"
        self.stdout = tmp / "up.stdout"
        with open(self.stderr, "w") as err, open(self.stdout, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "minedraft", "up", "--model", pair[0], "--port", str(self.port),
                 "--speculative-config", json.dumps({**SPEC, "model": pair[1]}), "--device", "cpu",
                 "--batch-invariant", "--max-num-seqs", "16", "--max-model-len", "128", "--log-level", "WARNING",
                 "--log-dir", str(self.log_dir), *SUPERVISION, *flags,
                 *([] if "--colocate-drafter" in flags else ["--no-colocate-drafter"]),  # a drafter process to kill
                 *([] if "--metrics-port" in flags else ["--metrics-port", "0"])],  # stacks run side by side
                stdout=out, stderr=err, env={**os.environ, **(env or {})},
            )  # fmt: skip
        deadline = time.monotonic() + 240
        while not serving(self.address, timeout_s=1):
            assert self.process.poll() is None, f"up exited during start-up: {self.stderr.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"{self.address} is not serving after 240 s"
            time.sleep(0.2)
        # `up` supervises once it has seen the stack serve and said so (a death before that fails its start-up).
        deadline = time.monotonic() + 60
        while "is serving on" not in self.stdout.read_text():
            assert time.monotonic() < deadline, "up never said it serves"
            time.sleep(0.1)

    def services(self) -> dict[str, list[tuple[int, int]]]:
        """(pid, --port) of each running service process, by role."""
        found: dict[str, list[tuple[int, int]]] = {}
        for pid in children(self.process.pid):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
                role, port = args[args.index("minedraft") + 1], int(args[args.index("--port") + 1])
            except (OSError, ValueError):  # gone, or not yet exec'd (a zombie has no command line)
                continue
            found.setdefault(role, []).append((pid, port))
        return found

    def kill(self, role: str, port: int | None = None) -> tuple[int, int]:
        """SIGKILL the service `role` (the one on `port`, with several); returns its (pid, port)."""
        pid, port = next(s for s in self.services()[role] if port is None or s[1] == port)
        os.kill(pid, signal.SIGKILL)
        return pid, port

    def back(self, role: str, old: tuple[int, int]) -> tuple[int, int] | None:
        """The service that replaced `old` (pid, port) on the same port, if it serves."""
        new = [s for s in self.services().get(role, []) if s[0] != old[0] and s[1] == old[1]]
        return new[0] if new and serving(f"127.0.0.1:{new[0][1]}", timeout_s=1) else None

    def restarted(self, role: str, old: tuple[int, int], timeout_s: float = 30) -> tuple[int, int]:
        """The service that replaced `old`, once it serves."""
        deadline = time.monotonic() + timeout_s
        while (new := self.back(role, old)) is None:
            assert time.monotonic() < deadline, f"the {role} did not serve again within {timeout_s}s"
            time.sleep(0.2)
        return new

    def said(self) -> str:
        return self.stderr.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=120)


def _streams(address: str, prompts: list[list[int]], **client_options) -> list[Future]:
    """One greedy generate per prompt in the background; each future: token ids or the gRPC status name."""

    def one(prompt: list[int]) -> list[int] | str:
        with Client(address, timeout=180, **client_options) as client:
            try:
                return client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).token_ids
            except grpc.RpcError as exc:
                return exc.code().name

    pool = ThreadPoolExecutor(len(prompts))
    futures = [pool.submit(one, p) for p in prompts]
    pool.shutdown(wait=False)
    return futures


def _wait_active(address: str, at_least: int = 4, timeout_s: float = 60) -> None:
    """Until a worker holds requests: the streams are mid-flight."""
    deadline = time.monotonic() + timeout_s
    while worker_info(address).num_active_sequences < at_least:
        assert time.monotonic() < deadline, "the requests never reached the workers"
        time.sleep(0.05)


def _served_within(address: str, since: float, limit_s: float = 30) -> float:
    """Seconds from `since` until a new request is served (retrying UNAVAILABLE, as the SDK does). Beside the
    16 streams it waits for a free sequence slot too, so callers with streams in flight give it longer."""
    retries = RetryPolicy(max_attempts=100, max_backoff=0.5)
    with Client(address, timeout=limit_s, retries=retries) as client:
        assert client.generate([3, 1, 4], max_tokens=4, temperature=0, ignore_eos=True).usage.completion_tokens == 4
    took = time.monotonic() - since
    assert took < limit_s, f"a new request was served {took:.1f}s after the kill"
    return took


def _wait_tokens_at(metrics_port: int, since: float, more: float = 64, timeout_s: float = 60) -> None:
    """Until a group's scheduler has generated `more` tokens past `since` (its count then): its streams are
    mid-flight."""
    deadline = time.monotonic() + timeout_s
    while _metric(metrics_port, "minedraft:generation_tokens_total") < since + more:
        assert time.monotonic() < deadline, "the group never generated"
        time.sleep(0.05)


def _health_while(condition: Callable[[], bool], address: str, timeout_s: float = 180) -> set[str]:
    """The scheduler's health statuses seen until `condition` holds (a liveness bound, as the streams' 240 s: a
    restarted service imports torch and loads its model while the other test worker loads the same cores)."""
    seen, deadline = set(), time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        seen.add(health(address))
        time.sleep(0.05)
    return seen


@pytest.fixture(scope="module")
def up(pair, tmp_path_factory):
    """One group in MineDraft mode under `up`; a drafter started while the fault file exists fails at once."""
    tmp = tmp_path_factory.mktemp("up")
    (tmp / "fault").mkdir()
    (tmp / "fault" / "sitecustomize.py").write_text(FAULT)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp / "fault"), os.environ.get("PYTHONPATH", "")]),
           "MINEDRAFT_TEST_FAULT_FILE": str(tmp / "fail-drafter")}  # fmt: skip
    stack = Up(pair, tmp, env=env)
    stack.fault = tmp / "fail-drafter"
    yield stack
    stack.stop()


def test_a_killed_drafter_is_restarted_and_no_request_is_lost(up, expected) -> None:
    streams = _streams(up.address, _prompts(), retries=0)
    [(verifier, verifier_port)] = up.services()["verifier"]
    _wait_active(f"127.0.0.1:{verifier_port}")
    old = up.kill("drafter")
    killed_at = time.monotonic()
    # the 17th request: it waits for a stream to finish as well as for the group (max-num-seqs 16)
    new_request = ThreadPoolExecutor(1).submit(_served_within, up.address, killed_at, 180)

    # target-only decoding serves: the scheduler stays SERVING from the kill until the drafter is back in its world
    def rejoined() -> bool:
        new = up.back("drafter", old)
        return new is not None and worker_info(f"127.0.0.1:{new[1]}").epoch > 0

    assert _health_while(rejoined, up.address) <= {"SERVING"}
    _, drafter_port = up.restarted("drafter", old)
    assert [f.result(timeout=240) for f in streams] == expected
    new_request.result(timeout=200)
    assert up.process.poll() is None
    assert "the drafter was killed by SIGKILL; restarting it in 1s (restart 1)" in up.said()
    # speculation resumed: the restarted drafter is in the scheduler's world again
    assert worker_info(f"127.0.0.1:{drafter_port}").epoch == worker_info(f"127.0.0.1:{verifier_port}").epoch


def test_a_killed_verifier_is_restarted_and_its_requests_are_held(up, expected) -> None:
    streams = _streams(up.address, _prompts(), retries=0)
    [(_, verifier_port)] = up.services()["verifier"]
    _wait_active(f"127.0.0.1:{verifier_port}")
    old = up.kill("verifier")
    killed_at = time.monotonic()
    # the 17th request: it waits for a stream to finish as well as for the group (max-num-seqs 16)
    new_request = ThreadPoolExecutor(1).submit(_served_within, up.address, killed_at, 180)
    # nothing can decode while no verifier serves: NOT_SERVING until the group is formed again
    assert "NOT_SERVING" in _health_while(lambda: up.back("verifier", old) is not None, up.address)
    up.restarted("verifier", old)
    assert [f.result(timeout=240) for f in streams] == expected
    new_request.result(timeout=200)
    assert up.process.poll() is None
    assert "the verifier was killed by SIGKILL; restarting it in 1s (restart 1)" in up.said()


def test_a_killed_verifier_that_drafts_itself_is_restarted_and_no_request_is_lost(pair, expected, tmp_path) -> None:
    """--colocate-drafter: one process holds both models; killed, it is restarted like a verifier, and the
    group speculates through it again."""
    fixed = json.dumps({**SPEC, "model": pair[1], "adaptive": False})  # it drafts whatever the acceptance
    # --metrics-port 0: the module's `up` holds the default metrics port
    stack = Up(pair, tmp_path, "--colocate-drafter", "--speculative-config", fixed, "--metrics-port", "0")
    try:
        assert "drafter" not in stack.services()
        streams = _streams(stack.address, _prompts(), retries=0)
        [(_, verifier_port)] = stack.services()["verifier"]
        _wait_active(f"127.0.0.1:{verifier_port}")
        old = stack.kill("verifier")
        _, port = stack.restarted("verifier", old, timeout_s=120)  # it loads both models
        assert [f.result(timeout=240) for f in streams] == expected
        assert worker_info(f"127.0.0.1:{port}").draft_num_blocks > 0
        with Client(stack.address, timeout=60) as client:
            stats = client.generate([3, 1, 4], max_tokens=24, temperature=0, ignore_eos=True).spec_decode_stats
        assert stats.num_draft_tokens > 0  # speculating again, through the restarted process
        assert "the verifier was killed by SIGKILL; restarting it in 1s (restart 1)" in stack.said()
        # `bench --chaos` reads a colocated stack too (its scheduler runs with `--drafter ""`)
        result = subprocess.run(
            [sys.executable, "-m", "minedraft", "bench", "--chaos", "--target", stack.address, "--chaos-targets",
             "scheduler", "--chaos-interval", "6", "--chaos-duration", "8", "--dataset", "random", "--input-len", "16",
             "--num-prompts", "4", "--max-tokens", "16", "--concurrency", "4", "--tokenizer", pair[0]],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SIGKILL group 0 scheduler" in result.stdout and "requests lost:          0 of" in result.stdout
    finally:
        stack.stop()


def test_a_killed_scheduler_is_restarted_with_every_kv_block_free(up) -> None:
    """Without a gateway its clients get UNAVAILABLE (as in the cluster); the new scheduler serves again."""
    streams = _streams(up.address, _prompts(), retries=0)
    workers = {role: f"127.0.0.1:{up.services()[role][0][1]}" for role in ("verifier", "drafter")}
    _wait_active(workers["verifier"])
    old = up.kill("scheduler")
    killed_at = time.monotonic()
    outcomes = [f.result(timeout=60) for f in streams]
    assert "UNAVAILABLE" in outcomes and all(o == "UNAVAILABLE" or len(o) == MAX_TOKENS for o in outcomes)
    up.restarted("scheduler", old)
    for role, address in workers.items():  # the new scheduler's world holds nothing of the old one's
        info = worker_info(address)
        assert (info.num_active_sequences, info.num_free_blocks) == (0, info.num_blocks), (role, info)
    _served_within(up.address, killed_at)
    assert up.process.poll() is None


def test_bench_chaos_kills_a_scheduler_and_no_request_is_lost(up, pair) -> None:
    """`minedraft bench --chaos` against this `up`: one scheduler kill under load; the SDK resumes the broken
    streams on the restarted scheduler, and every output equals the undisturbed pass."""
    result = subprocess.run(
        [sys.executable, "-m", "minedraft", "bench", "--chaos", "--target", up.address, "--chaos-targets", "scheduler",
         "--chaos-interval", "6", "--chaos-duration", "8", "--dataset", "random", "--input-len", "16",
         "--num-prompts", "4", "--max-tokens", "32", "--concurrency", "4", "--tokenizer", pair[0]],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SIGKILL group 0 scheduler" in result.stdout and "healed after" in result.stdout
    assert "requests lost:          0 of" in result.stdout
    assert "outputs != undisturbed: 0 of" in result.stdout
    assert up.process.poll() is None


def test_a_service_that_fails_on_every_restart_stops_up_with_one_line(up) -> None:
    """Last: it ends the module's `up`. The drafter served; from now on each start of it exits with code 3."""
    up.fault.touch()
    pids = [pid for services in up.services().values() for pid, _ in services]
    up.kill("drafter")
    assert up.process.wait(timeout=60) == 1
    lines = [line for line in up.said().splitlines() if "crash-loops" in line]
    assert lines == [f"minedraft up: the drafter exited with code 3 after 3 restarts in 60s (--crash-loop-restarts "
                     f"3): it crash-loops, see {up.log_dir / 'drafter.log'}; stopping every service"]  # fmt: skip
    assert "minedraft up: restarts: drafter" in up.said()
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == [], "services outlived minedraft up"


# `up --engine-groups 2`: the gateway is restarted as the groups' services are; streams migrate meanwhile.

KEY = "up-key"


def _pools(http_port: int) -> dict[str, dict | None]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/debug/drafter-pool", timeout=30) as reply:
        return json.loads(reply.read())["groups"]


def test_a_killed_pool_drafter_is_restarted_no_request_is_lost_and_both_groups_speculate_again(
        pair, expected, tmp_path) -> None:  # fmt: skip
    """`up --engine-groups 2 --drafter-pool 1`: 16 streams per group, the pool's one drafter SIGKILLed mid-stream.
    Every stream completes with the plain text; `up` restarts the drafter and both groups bind to it again."""
    http_port = free_port()
    stack = Up(pair, tmp_path, "--engine-groups", "2", "--drafter-pool", "1", "--http-port", str(http_port))
    try:
        assert len(_pools(http_port)) == 2 and all(pool["bound"] for pool in _pools(http_port).values())
        streams = _streams(stack.address, _prompts() * 2, retries=0)
        [(_, drafter_port)] = stack.services()["drafter"]
        _wait_active(f"127.0.0.1:{drafter_port}", at_least=8)
        old = stack.kill("drafter")
        assert [f.result(timeout=240) for f in streams] == expected * 2
        stack.restarted("drafter", old)
        restarted_at = time.monotonic()
        while not all(pool and pool["bound"] for pool in _pools(http_port).values()):
            assert time.monotonic() - restarted_at < 30, f"not every group drafts again: {_pools(http_port)}"
            time.sleep(0.2)
        print(f"both groups draft again {time.monotonic() - restarted_at:.1f}s after the restart")
        assert "the pool 0 drafter was killed by SIGKILL; restarting it in 1s" in stack.said()
        chaos = subprocess.run(  # `bench --chaos` finds the pool drafter and waits until a group binds to it again
            [sys.executable, "-m", "minedraft", "bench", "--chaos", "--target", stack.address, "--chaos-targets",
             "drafter", "--chaos-interval", "4", "--chaos-duration", "6", "--dataset", "random", "--input-len", "16",
             "--num-prompts", "8", "--max-tokens", "32", "--concurrency", "8", "--tokenizer", pair[0]],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert chaos.returncode == 0, chaos.stdout + chaos.stderr
        assert "SIGKILL pool drafter" in chaos.stdout and "healed after" in chaos.stdout
        assert "requests lost:          0 of" in chaos.stdout
        assert "outputs != undisturbed: 0 of" in chaos.stdout
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def texts(pair) -> list[str]:
    """Offline autoregressive text of each prompt: what every SSE stream must carry, byte for byte."""
    engine = LLMEngine.local(tiny_config(pair, None, max_num_seqs=16))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in _prompts()]
    while engine.has_unfinished():
        engine.step()
    return [r.text for r in requests]


@pytest.fixture(scope="module")
def groups(pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up-groups")
    # Its tests kill group 0's scheduler up to four times within a minute (a kill that lands too late is retried).
    stack = Up(pair, tmp, "--engine-groups", "2", "--http-port", str(free_port()), "--api-key", KEY,
               "--metrics-port", str(free_port(span=2)), "--crash-loop-restarts", "6")  # fmt: skip
    stack.http_port = int(stack.process.args[stack.process.args.index("--http-port") + 1])
    yield stack
    stack.stop()


def _sse(http_port: int, prompts: list[list[int]]) -> list[Future]:
    """One streamed (SSE) greedy completion per prompt through the gateway; each future: the text."""
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=KEY, max_retries=0, timeout=180)

    def one(prompt: list[int]) -> str:
        chunks = api.completions.create(model="target", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

    pool = ThreadPoolExecutor(len(prompts))
    futures = [pool.submit(one, p) for p in prompts]
    pool.shutdown(wait=False)
    return futures


def _group_metrics_port(scheduler_pid: int) -> int:
    args = Path(f"/proc/{scheduler_pid}/cmdline").read_bytes().decode().split("\0")
    return json.loads(args[args.index("--scheduler-settings") + 1])["metrics_port"]


def _metric(metrics_port: int, name: str) -> float:
    """A series of a scheduler's (or the gateway's HTTP) /metrics, summed over its labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.split("{")[0].split(" ")[0] == name)


def _group_ports(scheduler_pid: int) -> dict[str, int]:
    """The ports of a group's services, from its scheduler's command line."""
    args = Path(f"/proc/{scheduler_pid}/cmdline").read_bytes().decode().split("\0")
    port = {flag: int(args[args.index(flag) + 1].rsplit(":", 1)[1]) for flag in ("--verifier", "--drafter")}
    return {"scheduler": int(args[args.index("--port") + 1]), "verifier": port["--verifier"],
            "drafter": port["--drafter"]}  # fmt: skip


def _finished(metrics_port: int) -> float:
    return _metric(metrics_port, "minedraft:request_success_total")


@pytest.mark.parametrize("roles", [("scheduler",), ("scheduler", "verifier", "drafter")], ids=["scheduler", "group"])
def test_streams_through_the_gateway_survive_a_group_kill(groups, texts, roles) -> None:
    """16 SSE streams; one group's scheduler (or all its services, as a lost node) SIGKILLed mid-stream: every
    stream completes byte for byte on the other group, and the killed group serves again within 30 s and takes
    new work."""
    # group 0: the one whose metrics port is --metrics-port itself (group i serves on port + i)
    metrics_port, pid = min((_group_metrics_port(pid), pid) for pid, _ in groups.services()["scheduler"])
    ports = _group_ports(pid)
    # The gateway may give group 0 few of the streams; a kill that lands after they finished moves nothing and
    # proves nothing (every text still arrives), so it is tried once more.
    for _ in range(2):
        migrated = _metric(groups.http_port, "minedraft:gateway_resubmissions_total")
        generated = _metric(metrics_port, "minedraft:generation_tokens_total")
        streams = _sse(groups.http_port, _prompts())
        _wait_tokens_at(metrics_port, since=generated, more=8)
        killed = [groups.kill(role, ports[role]) for role in roles]
        killed_at = time.monotonic()
        assert [f.result(timeout=240) for f in streams] == texts
        for role, old in zip(roles, killed, strict=True):
            groups.restarted(role, old)
        while _metric(groups.http_port, "minedraft:gateway_serving_groups") < 2:  # the gateway sees it serve
            assert time.monotonic() - killed_at < 30, "the killed group did not serve again within 30 s"
            time.sleep(0.1)
        print(f"group 0 serves at the gateway again {time.monotonic() - killed_at:.1f}s after the kill of its {roles}")
        if _metric(groups.http_port, "minedraft:gateway_resubmissions_total") > migrated:
            break
    else:
        pytest.fail("no stream migrated: both kills landed after group 0's streams had finished")
    before = _finished(metrics_port)
    assert [f.result(timeout=240) for f in _sse(groups.http_port, _prompts())] == texts
    assert _finished(metrics_port) > before, "the restarted group took no new work"
    assert groups.process.poll() is None
    assert "the group 0 scheduler was killed by SIGKILL; restarting it in 1s" in groups.said()


def test_a_killed_gateway_is_restarted(groups) -> None:
    killed = groups.kill("gateway")
    killed_at = time.monotonic()
    groups.restarted("gateway", killed)
    with Client(groups.address, timeout=30, token=KEY, retries=RetryPolicy(max_attempts=100, max_backoff=0.5)) as c:
        assert c.generate([3, 1, 4], max_tokens=4, temperature=0, ignore_eos=True).usage.completion_tokens == 4
    assert time.monotonic() - killed_at < 30
    assert groups.process.poll() is None
    assert "the gateway was killed by SIGKILL; restarting it in 1s (restart 1)" in groups.said()


def _stream_through(address: str, prompt: list[int], started: threading.Event, aio: bool,
                    **sampling) -> tuple[str, list[int]]:  # fmt: skip
    """One stream through the SDK (sync or asyncio), patient enough to outlast a restart of the gateway;
    `started` is set at its first delta."""
    retries, options = RetryPolicy(max_attempts=100, max_backoff=0.5), {"max_tokens": MAX_TOKENS, "ignore_eos": True}

    def take(deltas: list) -> tuple[str, list[int]]:
        return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]

    async def run_async() -> tuple[str, list[int]]:
        async with AsyncClient(address, timeout=180, token=KEY, retries=retries) as client:
            return take([started.set() or d async for d in client.stream(prompt, **options, **sampling)])

    if aio:
        return asyncio.run(run_async())
    with Client(address, timeout=180, token=KEY, retries=retries) as client:
        return take([started.set() or d for d in client.stream(prompt, **options, **sampling)])


def test_streams_through_a_killed_gateway_are_resumed_by_the_sdk(groups, texts, expected) -> None:
    """The gateway SIGKILLed mid-stream: each SDK stream (sync and asyncio) is resubmitted from where it broke
    through the restarted gateway and completes as one undisturbed run, text and tokens byte for byte."""
    started = [threading.Event() for _ in _prompts()]
    with ThreadPoolExecutor(len(started)) as pool:
        streams = [pool.submit(_stream_through, groups.address, prompt, event, i % 2 == 1, temperature=0)
                   for i, (prompt, event) in enumerate(zip(_prompts(), started, strict=True))]  # fmt: skip
        assert all(event.wait(60) for event in started), "the streams never started"
        killed = groups.kill("gateway")
        unfinished = sum(not f.done() for f in streams)
        results = [f.result(timeout=180) for f in streams]
    assert unfinished > 0, "every stream had finished before the kill"
    assert [ids for _, ids in results] == expected
    assert [text for text, _ in results] == texts
    groups.restarted("gateway", killed)
    assert groups.process.poll() is None


class _Exits:
    """One real service that exits with code 3 each time it starts (the Supervised protocol)."""

    def __init__(self) -> None:
        self.process = self.restart("worker")

    def processes(self) -> list[tuple[str, subprocess.Popen]]:
        return [("worker", self.process)]

    def restart(self, name: str) -> subprocess.Popen:
        self.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        return self.process

    def log_path(self, name: str) -> Path | None:
        return None


def test_back_off_doubles_up_to_its_cap_and_a_crash_loop_ends_supervision() -> None:
    said = io.StringIO()
    settings = SupervisorSettings(restart_backoff_max=2, crash_loop_restarts=3, crash_loop_window=60)
    assert Supervisor(_Exits(), settings, out=said).run(poll_s=0.05) == 1
    prefix = "minedraft up: the worker exited with code 3"
    assert said.getvalue().splitlines() == [
        f"{prefix}; restarting it in 1s (restart 1)",
        f"{prefix}; restarting it in 2s (restart 2)",
        f"{prefix}; restarting it in 2s (restart 3)",
        f"{prefix} after 3 restarts in 60s (--crash-loop-restarts 3): it crash-loops, its output is above; stopping "
        "every service",
        "minedraft up: restarts: worker 3",
    ]  # fmt: skip
