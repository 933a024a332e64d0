"""A drafter pool: pool drafters that serve several engine groups, real processes throughout.

- two groups drafting with one pool drafter at once: greedy output of each equals offline plain decoding, in sd
  and adaptive MineDraft modes, and drafts were accepted (fixed MineDraft: the tests after it);
- the pool drafter SIGKILLed while 16 requests per group stream: 32/32 complete with the plain text, and both
  groups speculate again after it restarts;
- seeded sampling: streams wait for the killed pool drafter and keep their text (against a control that does
  not wait), and streams migrated mid-window by the gateway keep theirs;
- a group with two verifier ranks: rank 0 hands the pool drafter's windows on to rank 1;
- two pool drafters: the groups spread over them, and killing one moves its group to the other;
- a pool drafter that is full takes no more groups: the group left over decodes target-only, text unchanged;
- draft parts that wait together are drafted in one plan;
- what a pool cannot serve (EAGLE heads, LoRA) is refused by name; the hand-over's pieces (inbox, wire).

Strict kernels throughout, so speculative and plain outputs are bit-identical.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from minedraft.api import worker_pb2
from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.engine.engine import LLMEngine
from minedraft.engine.plans import Admission, DraftPlan, Drafts, DraftTask, StepResult, Verified
from minedraft.pool import check_poolable
from minedraft.pool.link import Inbox, PeerGone
from minedraft.pool.member import PoolMember, _Group
from minedraft.sampling.params import SamplingParams
from minedraft.settings import GatewaySettings
from minedraft.stack.gateway import GatewayStack
from minedraft.stack.local import free_port, scheduler_settings
from minedraft.wire import drafts_from_exchange, drafts_to_exchange, results_to_exchange, verified_from_proto

from services import QUICK_STOP

MAX_TOKENS = 40
PAIR_SEED = 3  # the pair of conftest's `pair`
FIELDS = {"max_num_seqs": 16, "max_model_len": 160, "device": "cpu", "batch_invariant": True}


def _config(pair, tensor_parallel_size: int = 1, **spec) -> EngineConfig:
    spec = {"model": pair[1], "num_speculative_tokens": 4, "is_parallel": True, "adaptive": False, **spec}
    return EngineConfig(model=pair[0], speculative_config=spec, tensor_parallel_size=tensor_parallel_size, **FIELDS)


def _prompts(n: int) -> list[list[int]]:
    return [[40 + i % 50, 41, 42 + i % 7] * (1 + i % 3) + [40 + i % 11] for i in range(n)]


@pytest.fixture(scope="module")
def plain(pair) -> dict[tuple[int, ...], list[int]]:
    """Offline plain decoding of every prompt the tests send."""
    engine = LLMEngine.local(EngineConfig(model=pair[0], **FIELDS))
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompts = _prompts(32)
        requests = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return {tuple(p): r.output_ids for p, r in zip(prompts, requests)}
    finally:
        engine.executor.close()


@pytest.fixture(scope="module")
def two_groups(pair, tmp_path_factory):
    """Two groups drafting with one pool drafter, by speculative config (_config's keys): each started when a test
    first asks for it and shared by the tests after it; the migration test, which SIGKILLs a group, comes last."""
    stacks: dict[str, GatewayStack] = {}

    def get(**spec) -> GatewayStack:
        config = _config(pair, **spec)
        key = config.model_dump_json()
        if key not in stacks:
            stack = GatewayStack(config, 2, drafter_pool=1, worker=QUICK_STOP,
                                 log_dir=tmp_path_factory.mktemp("two-groups"))  # fmt: skip
            stack.start()
            stacks[key] = stack
        return stacks[key]

    yield get
    for stack in stacks.values():
        stack.stop()


def _generate(address: str, prompts: list[list[int]]) -> list:
    with Client(address, timeout=180) as client, ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                             prompts))  # fmt: skip


def _bound(address: str) -> str:
    with Client(address, timeout=30) as client:
        pool = client.server_info().drafter_pool
    assert pool is not None, "a group of a pool tells its binding in GetServerInfo"
    return pool.bound


def _members(address: str, until, timeout_s: float = 10) -> list[tuple]:
    """(address, serving, groups, capacity) of each member as the group sees them, once `until(them)` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        with Client(address, timeout=30) as client:
            members = [(m.address, m.serving, m.groups, m.capacity) for m in client.server_info().drafter_pool.members]
        if until(members) or time.monotonic() > deadline:
            return members
        time.sleep(0.2)


def _wait_bound(address: str, timeout_s: float, unlike: str = "") -> tuple[str, float]:
    """The member the group is bound to once it drafts with one other than `unlike`, and how long that took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        bound = _bound(address)
        if bound and bound != unlike:
            return bound, time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"the group at {address} did not bind to a pool drafter within {timeout_s:.0f}s")


@pytest.mark.parametrize("spec", [
    {"is_parallel": False},
    {"adaptive": True},
], ids=["sd", "minedraft-adaptive"])  # fixed MineDraft: the SIGKILL and migration tests below
def test_two_groups_sharing_one_pool_drafter_equal_plain_decoding(plain, spec, two_groups) -> None:
    prompts = _prompts(8)
    stack = two_groups(**spec)
    member = stack.pool.addresses[0]
    assert [_bound(group.address) for group in stack.groups] == [member, member]
    with ThreadPoolExecutor(2) as both:  # at once: the member steps the two groups side by side
        runs = list(both.map(lambda group: _generate(group.address, prompts), stack.groups))
    for outs in runs:
        assert [o.token_ids for o in outs] == [plain[tuple(p)] for p in prompts]
        if not spec.get("adaptive"):  # adaptive speculation may choose plain steps for the toy pair
            assert sum(o.spec_decode_stats.num_accepted_tokens for o in outs) > 0
    assert _members(stack.groups[0].address, lambda m: m[0][2] == 2) == [(member, True, 2, 2)]


def test_a_pool_drafter_serves_a_group_with_two_verifier_ranks(pair, plain, tmp_path) -> None:
    """Tensor parallelism: verifier rank 0 takes the pool drafter's windows and hands them on to rank 1."""
    prompts = _prompts(6)
    config = _config(pair, tensor_parallel_size=2)
    with GatewayStack(config, 1, drafter_pool=1, worker=QUICK_STOP, log_dir=tmp_path) as stack:
        outs = _generate(stack.groups[0].address, prompts)
        assert [o.token_ids for o in outs] == [plain[tuple(p)] for p in prompts]
        assert sum(o.spec_decode_stats.num_accepted_tokens for o in outs) > 0


def _stream_all(stack: GatewayStack, prompts: list[list[int]], strike, after_tokens: int) -> dict:
    """Stream every prompt through both groups at once (each group its half), and `strike()` once `after_tokens`
    tokens came back over all. Returns each prompt's token ids, or the error it ended with."""
    outputs: dict[tuple[int, ...], object] = {}
    produced, struck = [0], threading.Event()
    lock = threading.Lock()

    def run(address: str, prompt: list[int]) -> None:
        tokens: list[int] = []
        try:
            with Client(address, timeout=300) as client:
                for delta in client.stream(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True):
                    tokens += delta.token_ids
                    with lock:
                        produced[0] += len(delta.token_ids)
                        fire = produced[0] >= after_tokens and not struck.is_set()
                        if fire:
                            struck.set()
                    if fire:
                        strike()
            outputs[tuple(prompt)] = tokens
        except Exception as exc:  # noqa: BLE001 (reported by the test)
            outputs[tuple(prompt)] = exc

    half = len(prompts) // 2
    jobs = [(stack.groups[0].address, p) for p in prompts[:half]] + [(stack.groups[1].address, p)
                                                                      for p in prompts[half:]]  # fmt: skip
    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(lambda job: run(*job), jobs))
    assert struck.is_set(), "the requests finished before the strike"
    return outputs


def test_a_sigkilled_pool_drafter_costs_no_request_and_both_groups_speculate_again(plain, two_groups) -> None:
    prompts = _prompts(32)
    stack = two_groups()
    outputs = _stream_all(stack, prompts, lambda: stack.pool.kill(0), after_tokens=200)
    assert {p: o for p, o in outputs.items() if not isinstance(o, list)} == {}
    assert outputs == {tuple(p): plain[tuple(p)] for p in prompts}
    stack.pool.restart(0)
    for group in stack.groups:
        bound, _ = _wait_bound(group.address, timeout_s=30)
        assert bound == stack.pool.addresses[0]
    after = _generate(stack.groups[1].address, prompts[:4])
    assert [o.token_ids for o in after] == [plain[tuple(p)] for p in prompts[:4]]
    assert sum(o.spec_decode_stats.num_accepted_tokens for o in after) > 0


def _sampled(address: str, prompts: list[list[int]], strike=None) -> list[list[int]]:
    """Stream each prompt seeded-sampled (seed 100 + its index) at once; `strike()` once 60 tokens came."""
    produced, lock, struck = [0], threading.Lock(), threading.Event()

    def one(i_prompt) -> list[int]:
        i, prompt = i_prompt
        tokens = []
        with Client(address, timeout=300) as client:
            for delta in client.stream(prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i,
                                       ignore_eos=True):  # fmt: skip
                tokens += delta.token_ids
                with lock:
                    produced[0] += len(delta.token_ids)
                    fire = strike is not None and produced[0] >= 60 and not struck.is_set()
                    if fire:
                        struck.set()
                if fire:
                    strike()
        return tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(one, enumerate(prompts)))
    assert strike is None or struck.is_set(), "the requests finished before the strike"
    return outputs


def test_seeded_sampled_streams_wait_for_the_pool_drafter_and_keep_their_text(pair, tmp_path) -> None:
    """Seeded sampling: where a request's windows fall decides its text. With the pool drafter SIGKILLed mid-stream
    (and back a second later, as `up` restarts it), the seeded requests wait instead of decoding target-only, so
    each text equals the undisturbed run's, token for token."""
    prompts = _prompts(8)

    texts = {}
    for wait in (60.0, 0.0):  # 0: the control, decoding target-only at once, gives other texts
        scheduler = scheduler_settings(seeded_drafter_wait=wait)
        with GatewayStack(_config(pair), 1, drafter_pool=1, scheduler=scheduler, worker=QUICK_STOP,
                          log_dir=tmp_path / str(wait)) as stack:
            group = stack.groups[0].address
            undisturbed = _sampled(group, prompts)

            def kill_and_restart() -> None:
                stack.pool.kill(0)
                threading.Timer(1.0, stack.pool.restart, args=(0,)).start()

            texts[wait] = (undisturbed, _sampled(group, prompts, strike=kill_and_restart))
    assert texts[60.0][1] == texts[60.0][0]
    assert texts[0.0][1] != texts[0.0][0], "the control: without the wait, a target-only stretch changes the text"


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_seeded_sampled_streams_migrated_mid_window_keep_their_text(two_groups, adaptive) -> None:
    """Through the gateway, MineDraft mode: one group SIGKILLed mid-stream (its scheduler and verifier; the pool
    drafter serves on), its seeded streams resubmitted to the other group from the tokens streamed so far. Each
    re-enters at a verification's end, where its next window starts in the undisturbed run too: same texts."""
    prompts = _prompts(8)
    stack = two_groups(adaptive=adaptive)  # the last test of each: group 0 stays dead
    undisturbed = _sampled(stack.address, prompts)
    assert _sampled(stack.address, prompts, strike=lambda: stack.kill_group(0)) == undisturbed


def test_two_pool_drafters_share_the_groups_and_a_killed_one_hands_its_group_over(pair, plain, tmp_path) -> None:
    gateway = GatewaySettings(http_port=free_port())
    with GatewayStack(_config(pair), 2, drafter_pool=2, worker=QUICK_STOP, log_dir=tmp_path, gateway=gateway) as stack:
        bound = [_bound(g.address) for g in stack.groups]
        assert sorted(bound) == sorted(stack.pool.addresses), "each group takes the member with the most room"
        victim = stack.pool.addresses.index(bound[0])
        stack.pool.kill(victim)
        moved, seconds = _wait_bound(stack.groups[0].address, timeout_s=5, unlike=bound[0])
        assert moved == bound[1] and seconds < 5
        prompts = _prompts(6)
        for group in stack.groups:
            outs = _generate(group.address, prompts)
            assert [o.token_ids for o in outs] == [plain[tuple(p)] for p in prompts]
        with Client(stack.groups[0].address) as client:
            assert client.server_info().drafter_pool.rebinds == 1
        with urllib.request.urlopen(f"{stack.http_url}/debug/drafter-pool", timeout=30) as reply:
            view = json.loads(reply.read())["groups"]  # the gateway's view: every group's binding
        assert {address: pool["bound"] for address, pool in view.items()} == {
            stack.groups[0].address: bound[1], stack.groups[1].address: bound[1]}


def test_a_full_pool_drafter_takes_no_more_groups_and_the_one_left_decodes_target_only(pair, plain,
                                                                                        tmp_path) -> None:  # fmt: skip
    with GatewayStack(_config(pair), 2, drafter_pool=1, pool_groups=1, worker=QUICK_STOP, log_dir=tmp_path) as stack:
        bound = [_bound(g.address) for g in stack.groups]
        assert sorted(bound) == ["", stack.pool.addresses[0]]
        prompts = _prompts(6)
        for group in stack.groups:
            outs = _generate(group.address, prompts)
            assert [o.token_ids for o in outs] == [plain[tuple(p)] for p in prompts]


@pytest.mark.parametrize("fields, refused", [
    ({"speculative_config": {"method": "eagle3", "model": "x", "num_speculative_tokens": 2}}, "method eagle3"),
    ({"enable_lora": True, "speculative_config": {"model": "x", "num_speculative_tokens": 2}}, "LoRA"),
    ({}, "speculative"),
])  # fmt: skip
def test_what_a_pool_cannot_serve_is_refused_by_name(fields, refused) -> None:
    config = EngineConfig(**fields)
    with pytest.raises(ValueError, match=refused):
        check_poolable(config)


def test_the_cli_refuses_an_eagle_pool_before_starting_anything() -> None:
    import subprocess
    import sys

    spec = '{"method": "eagle3", "model": "/nonexistent", "num_speculative_tokens": 2}'
    run = subprocess.run([sys.executable, "-m", "minedraft", "scheduler", "--speculative-config", spec,
                          "--drafter-pool", "127.0.0.1:1"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode != 0
    assert "eagle3 cannot use a drafter pool" in run.stderr


def test_draft_parts_that_wait_together_are_drafted_in_one_plan(pair) -> None:
    """Three groups' parts wait while the model is busy: the first to get it drafts all three at once, and each
    group's windows equal those it drafts alone (greedy)."""
    member = PoolMember(_config(pair), capacity=3, timeout_s=10)
    groups = [_Group(f"g{i}", i, epoch=i + 1, link=None) for i in range(3)]  # no hand-over in this test
    plans = []
    for group, prompt in zip(groups, _prompts(3)):
        request = group.scoped("r")
        member.worker.admit([Admission(request, prompt, SamplingParams(temperature=0), seed=0)])
        plans.append(DraftPlan([DraftTask(request, 4)]))

    def draft_each(together: bool) -> list[list[int]]:
        replies = [StepResult() for _ in plans]
        if together:
            with member._model, ThreadPoolExecutor(3) as pool:  # busy: the three parts queue up
                futures = [pool.submit(member._draft, plan, reply) for plan, reply in zip(plans, replies)]
                while len(member._pending) < 3:
                    time.sleep(0.01)
                member._model.release()
                [f.result() for f in futures]
                member._model.acquire()
        else:
            for plan, reply in zip(plans, replies):
                member._draft(plan, reply)
        return [list(member.worker.take_drafts(owns=g.owns).popitem()[1].tokens) for g in groups]

    alone = draft_each(together=False)
    assert member.joint_parts == 0
    assert draft_each(together=True) == alone
    assert member.joint_parts == 3


def test_an_inbox_keeps_one_world_in_order_and_gives_up_when_it_closes_or_the_peer_dies() -> None:
    inbox = Inbox()
    inbox.open(7)
    assert not inbox.put(worker_pb2.ExchangeMessage(epoch=6, request_ids=["old"]))  # another world's: dropped
    for name in ("a", "b"):
        assert inbox.put(worker_pb2.ExchangeMessage(epoch=7, request_ids=[name]))
    assert [inbox.take(7, 1, lambda: True).request_ids[0] for _ in range(2)] == ["a", "b"]
    threading.Timer(0.2, inbox.close).start()
    with pytest.raises(PeerGone, match="left world 7"):
        inbox.take(7, 30, lambda: True)
    inbox.open(8)
    start = time.monotonic()
    with pytest.raises(PeerGone, match="stopped answering"):
        inbox.take(8, 30, lambda: False)
    assert time.monotonic() - start < 3


def test_windows_and_results_cross_the_wire_unchanged() -> None:
    support = 3
    windows = {
        "a": Drafts(tokens=[5, 6], q_ids=[torch.tensor([5, 1, 2]), torch.tensor([6, 0, 3])],
                    q_probs=[torch.tensor([0.5, 0.25, 0.25]), torch.tensor([1.0, 0.0, 0.0])]),
        "c": Drafts(),
    }  # fmt: skip
    message = drafts_to_exchange(3, ["a", "b", "c"], windows, support)
    back = drafts_from_exchange(worker_pb2.ExchangeMessage.FromString(message.SerializeToString()), support, "cpu")
    assert sorted(back) == ["a", "c"]  # b's window was dropped
    assert back["a"].tokens == [5, 6] and back["c"].tokens == []
    assert torch.equal(torch.stack(back["a"].q_ids), torch.stack(windows["a"].q_ids))
    assert torch.equal(torch.stack(back["a"].q_probs), torch.stack(windows["a"].q_probs))
    with pytest.raises(ValueError, match="expects 4"):
        drafts_from_exchange(message, 4, "cpu")
    results = [Verified("a", [1, 2, 3], 4, 2), Verified("b", [9], 0, 0)]
    assert verified_from_proto(results_to_exchange(3, results).results.verified) == results
