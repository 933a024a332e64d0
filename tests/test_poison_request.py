"""One request that makes every step fail is found and failed alone; every other stream completes unchanged.

The poison is real, not a mock: in the stack's processes (a `sitecustomize` on their PYTHONPATH, as
test_up_supervision.py kills a drafter) the verifier's forward raises whenever a request whose tokens start
with a given prefix is in the batch, as a kernel might on an input it cannot handle. Everything else is the
real stack: scheduler, drafter and verifier processes, gRPC, a gloo world that is re-formed after each failed
step.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from minedraft.client import Client, MineDraftError
from minedraft.config import EngineConfig
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

from conftest import offline_greedy

NUM_STREAMS = 16
MAX_TOKENS = 80
POISON = [317, 318, 319]  # no stream's prompt starts with these
# Run by every process of the stack before its main: VerifyWorker.forward raises on a batch holding the poison.
FAULT = f"""from minedraft.engine.workers import VerifyWorker

_forward = VerifyWorker.forward


def forward(self, plan):
    if any(self.sequences[t.request_id].tokens[:{len(POISON)}] == {POISON!r} for t in plan.tasks):
        raise RuntimeError("injected fault: a poison request is in the batch")
    return _forward(self, plan)


VerifyWorker.forward = forward
"""


PAIR_SEED = 5  # conftest's `pair` from this seed


def _config(pair, speculative: bool) -> EngineConfig:
    target, draft = pair
    spec = {"num_speculative_tokens": 3, "is_parallel": True, "model": draft} if speculative else None
    return EngineConfig(model=target, speculative_config=spec, max_num_seqs=8, max_model_len=160, device="cpu",
                        batch_invariant=True)  # fmt: skip


def _prompts() -> list[list[int]]:
    return [[(11 * i + j) % 300 + 1 for j in range(1 + i % 5)] for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def expected(pair) -> list[list[int]]:
    return offline_greedy(_config(pair, speculative=False), _prompts(), MAX_TOKENS)


def _quarantined(stack: LocalStack) -> float:
    text = urllib.request.urlopen(stack.http_url + "/metrics", timeout=10).read().decode()
    match = re.search(r"^minedraft:quarantined_requests_total (\S+)$", text, re.MULTILINE)
    return float(match.group(1))


@pytest.mark.parametrize("speculative", [True, False], ids=["minedraft", "ar"])
def test_a_poison_request_fails_alone_and_sixteen_streams_complete_unchanged(
    pair, expected, speculative, tmp_path, monkeypatch
) -> None:
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(FAULT)
    path = os.pathsep.join(filter(None, [str(tmp_path / "fault"), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)  # the stack's processes inherit it
    settings = scheduler_settings(http_port=free_port())
    with LocalStack(_config(pair, speculative), scheduler=settings, log_dir=tmp_path) as stack, \
            Client(stack.address, timeout=300, retries=0) as client:  # fmt: skip
        started = threading.Event()

        def stream(prompt: list[int]) -> list[int]:
            out: list[int] = []
            for delta in client.stream(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True):
                out += delta.token_ids
                started.set()
            return out

        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            streams = [pool.submit(stream, p) for p in _prompts()]
            assert started.wait(120), "no stream produced a token"
            with pytest.raises(MineDraftError) as failure:
                client.generate(POISON + [5, 6], max_tokens=MAX_TOKENS, temperature=0)
            outputs = [s.result(timeout=300) for s in streams]

        assert failure.value.code() == grpc.StatusCode.INTERNAL
        assert "no other request made it fail" in failure.value.details()
        assert outputs == expected  # every bystander: token for token what the target alone gives
        assert _quarantined(stack) == 1
        started_at = time.monotonic()
        canary = client.generate(_prompts()[0], max_tokens=8, temperature=0, ignore_eos=True)
        assert canary.token_ids == expected[0][:8] and time.monotonic() - started_at < 30
        log = (tmp_path / "scheduler.log").read_text()
        assert log.count("quarantined") == 1
