"""A worker or the scheduler dies (SIGKILL) under load, Kubernetes-style: the same command starts it again.

No request may be lost, and greedy output must equal the offline autoregressive output token for token
(strict kernels), whatever dies and whenever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.metrics import PREFIX_CACHE_HITS, scrape
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

from conftest import offline_greedy, tiny_config
from services import QUICK_STOP, TWO_PROCESSES, children, serving, wait_health, worker_info

NUM_STREAMS = 16
MAX_TOKENS = 100


PAIR_SEED = 3  # conftest's `pair` from this seed


def _config(pair, speculative: bool = True, tp: int = 1) -> EngineConfig:
    # Fixed k: the tests count drafts to see the drafter in the world, and adaptive speculation may rightly stop
    # drafting with this random pair.
    spec = {"num_speculative_tokens": 3, "is_parallel": True, "adaptive": False} if speculative else None
    return tiny_config(pair, spec, max_num_seqs=8, tensor_parallel_size=tp)


def _prompts() -> list[list[int]]:
    return [[(7 * i + j) % 300 + 1 for j in range(1 + i % 4)] for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def expected(pair) -> list[list[int]]:
    return offline_greedy(_config(pair, speculative=False), _prompts(), MAX_TOKENS)


class Load:
    """NUM_STREAMS greedy streams in the background; `wait_for_tokens` lets a test strike mid-stream."""

    def __init__(self, address: str) -> None:
        self.tokens = 0
        self._lock = threading.Lock()
        self._client = Client(address, timeout=180, retries=0)
        self._pool = ThreadPoolExecutor(NUM_STREAMS)
        self._results = [self._pool.submit(self._one, p) for p in _prompts()]

    def _one(self, prompt: list[int]) -> list[int]:
        out: list[int] = []
        for delta in self._client.stream(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True):
            out += delta.token_ids
            with self._lock:
                self.tokens += len(delta.token_ids)
        return out

    def wait_for_tokens(self, n: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tokens < n:
            assert time.monotonic() < deadline, f"only {self.tokens} tokens after {timeout_s}s"
            time.sleep(0.01)

    def results(self) -> list[list[int]]:
        try:
            return [r.result(timeout=240) for r in self._results]
        finally:
            self._pool.shutdown()
            self._client.close()


def _epoch(address: str) -> int:
    """The epoch a worker is in; 0 while it is not in a world or not up yet."""
    try:
        return worker_info(address).epoch
    except grpc.RpcError:
        return 0


def _until(condition, timeout_s: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _kill(stack: LocalStack, name: str) -> None:
    process = stack.process(name)
    process.kill()
    process.wait()


def _drafts_now(address: str) -> int:
    with Client(address, timeout=60) as client:
        return client.generate([5, 6, 7], max_tokens=20, temperature=0, ignore_eos=True).spec_decode_stats.num_drafts


@pytest.fixture(scope="module")
def group(pair):
    """The group the kill tests strike, started once per module and kind (tensor-parallel size; `hung`: the short
    timeouts of the SIGSTOP tests) when first asked for, as `up` keeps one group through kill after kill. Each test
    gets it whole: a service a test left dead is started again, and the group serves and drafts."""
    stacks: dict[tuple[int, bool], LocalStack] = {}

    def whole(tp: int = 1, hung: bool = False) -> LocalStack:
        if (tp, hung) not in stacks:
            # Hung: steps here take milliseconds, the default step deadline is 60 s.
            scheduler = scheduler_settings(metrics_port=free_port(), **({"step_deadline_floor": 8} if hung else {}))
            workers = TWO_PROCESSES.model_copy(update={"dist_timeout": 4}) if hung else TWO_PROCESSES
            stack = LocalStack(_config(pair, tp=tp), worker=workers, scheduler=scheduler)
            stack.start()
            stacks[tp, hung] = stack
        stack = stacks[tp, hung]
        for name, process in stack.processes():
            if process.poll() is not None:
                stack.restart(name)
        _until(lambda: serving(stack.address) and _drafts_now(stack.address) > 0, what="a whole group")
        return stack

    yield whole
    for stack in stacks.values():
        stack.stop()


@pytest.mark.parametrize("tp", [1, 2])
def test_drafter_dies_mid_stream_the_group_goes_on_and_takes_it_back(group, expected, tp: int) -> None:
    stack = group(tp)
    load = Load(stack.address)
    load.wait_for_tokens(200)
    _kill(stack, "drafter")
    assert load.results() == expected  # every stream completed, target-only after the kill
    assert _drafts_now(stack.address) == 0  # no drafter: plain autoregressive decoding
    stack.restart("drafter")
    _until(lambda: _epoch(stack.drafter_address) != 0, what="the drafter to rejoin")
    _until(lambda: _drafts_now(stack.address) > 0, timeout_s=30, what="drafts again")
    load = Load(stack.address)
    assert load.results() == expected


@pytest.mark.parametrize("tp", [1, 2])
def test_verifier_dies_mid_stream_requests_are_held_and_resumed(group, expected, tp: int) -> None:
    """With tp=2 the verifier's other rank dies with its rank 0 and comes back with it."""
    stack = group(tp)
    load = Load(stack.address)
    load.wait_for_tokens(200)
    _kill(stack, "verifier")
    wait_health(stack.address, "NOT_SERVING")  # the scheduler has seen it die: it holds the requests meanwhile
    stack.restart("verifier")
    assert load.results() == expected
    _until(lambda: serving(stack.address), what="the scheduler to serve again")
    assert _drafts_now(stack.address) > 0  # the drafter is back in the world too


def test_a_killed_tensor_parallel_rank_ends_its_verifier_and_requests_are_held_and_resumed(group, expected) -> None:
    """The verifier's other rank SIGKILLed: rank 0 cannot form a world without it, so it exits (code 1) for whoever
    started it to start every rank anew; meanwhile the scheduler holds the requests, as for a dead verifier."""
    stack = group(2)
    load = Load(stack.address)
    load.wait_for_tokens(200)
    verifier = stack.process("verifier")
    [rank_1] = children(verifier.pid)
    os.kill(rank_1, signal.SIGKILL)
    assert verifier.wait(timeout=60) == 1
    stack.restart("verifier")
    assert load.results() == expected
    _until(lambda: serving(stack.address), what="the scheduler to serve again")
    assert _drafts_now(stack.address) > 0


@pytest.mark.parametrize("victim", ["drafter", "verifier"])
def test_a_hung_worker_is_treated_like_a_dead_one(group, expected, victim: str) -> None:
    """SIGSTOP instead of SIGKILL: the peer gives up on it after --dist-timeout (a hung drafter: the
    scheduler, after the step deadline) and the group goes on as if it had died (target-only, or held
    requests); after SIGCONT it is taken back."""
    stack = group(hung=True)  # --dist-timeout 4, a step deadline of 8 s
    load = Load(stack.address)
    load.wait_for_tokens(200)
    process = stack.process(victim)
    process.send_signal(signal.SIGSTOP)
    try:
        if victim == "drafter":
            assert load.results() == expected  # completed target-only while the drafter hangs
        else:
            time.sleep(8)  # the drafter gives up on the verifier; the scheduler holds the requests
    finally:
        process.send_signal(signal.SIGCONT)
    if victim == "verifier":
        assert load.results() == expected
    _until(lambda: _epoch(stack.drafter_address) == _epoch(stack.verifier_address) != 0, what="a whole group")
    assert _drafts_now(stack.address) > 0


def test_new_scheduler_starts_with_free_caches(group, expected) -> None:
    """The scheduler is SIGKILLed with requests in flight; a new one (same command) forms a new epoch, in
    which the workers hold nothing, and serves 32 concurrent requests."""
    stack = group()
    load = Load(stack.address)
    load.wait_for_tokens(200)
    _kill(stack, "scheduler")
    with pytest.raises(grpc.RpcError) as info:
        load.results()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    old_epoch = worker_info(stack.verifier_address).epoch
    stack.restart("scheduler")
    _until(lambda: serving(stack.address), what="the new scheduler to serve")
    for address in (stack.verifier_address, stack.drafter_address):
        info = worker_info(address)
        assert info.epoch != old_epoch and info.num_active_sequences == 0
        assert info.num_free_blocks == info.num_blocks
    loads = [Load(stack.address), Load(stack.address)]
    assert [load.results() for load in loads] == [expected, expected]


def test_a_lone_scheduler_fails_requests_after_the_worker_wait(pair) -> None:
    """No verifier comes back: requests are held for --worker-wait, then fail with UNAVAILABLE saying why."""
    config = _config(pair, speculative=False)
    with LocalStack(config, worker=QUICK_STOP, workers_only=True) as workers:
        from minedraft.stack.local import engine_flags, free_port

        port, http_port = free_port(), free_port()
        scheduler = subprocess.Popen([
            sys.executable, "-m", "minedraft", "scheduler", *engine_flags(config), "--host", "127.0.0.1",
            "--port", str(port), "--metrics-port", "0", "--verifier", workers.verifier_address, "--worker-wait", "6",
            "--http-port", str(http_port),
        ])  # fmt: skip
        try:
            _until(lambda: serving(f"127.0.0.1:{port}"), what="the scheduler")
            _kill(workers, "verifier")
            with Client(f"127.0.0.1:{port}", timeout=60, retries=0) as client, ThreadPoolExecutor(1) as pool:
                held = pool.submit(client.generate, [1, 2, 3], max_tokens=50, temperature=0, ignore_eos=True)
                _until(lambda: _http_status(http_port, "/health") == 503, timeout_s=30, what="not serving")
                # Held, not failed yet: still not ready, and tools that poll /v1/models must see that too.
                assert _http_status(http_port, "/v1/models") == 503 and not held.done()
                with pytest.raises(grpc.RpcError) as info:
                    held.result()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "--worker-wait" in info.value.details()
            assert not serving(f"127.0.0.1:{port}")
        finally:
            scheduler.terminate()
            scheduler.wait(timeout=30)


def test_a_new_world_starts_with_an_empty_prefix_cache(group) -> None:
    """The drafter is SIGKILLed: the group forms a target-only world, in which the verifier has forgotten
    every cached block (nothing computed in an old world is trusted); the same prompt is computed afresh,
    gives the same tokens, and is cached again in the new world."""
    prompt = [(5 * j) % 300 + 1 for j in range(40)]  # two full blocks of 16 below its last token
    stack = group()
    with Client(stack.address, timeout=60) as client:
        url = f"http://127.0.0.1:{stack.metrics_port}/metrics"

        def hits_of_one_request() -> tuple[list[int], float]:
            before = scrape(url).get(PREFIX_CACHE_HITS + "_total", 0.0)
            tokens = client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True).token_ids
            return tokens, scrape(url)[PREFIX_CACHE_HITS + "_total"] - before

        first, _ = hits_of_one_request()
        assert hits_of_one_request() == (first, 32)
        _kill(stack, "drafter")
        _until(lambda: _drafts_now(stack.address) == 0, what="the target-only world")
        assert hits_of_one_request() == (first, 0)
        assert hits_of_one_request() == (first, 32)
