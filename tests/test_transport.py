"""The step-end tensor transport, with real processes and real gloo on 127.0.0.1.

Each world runs a scripted sequence of steps. Every rank rebuilds the same script from seeds, plays its
side of each transfer and checks what it received bit for bit; a child reports "ok" or its traceback
through a queue, and the parent fails the test on a traceback, a bad exit code or a timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch

from minedraft.engine.plans import Drafts, Verified
from minedraft.stack.local import free_port
from minedraft.transport import StepChannel, Topology, init_world, pick_backend
from minedraft.transport.channel import ids_hash
from minedraft.transport.groups import agree_backend, rendezvous_store

SUPPORT = 4
NUM_STEPS = 4
FEATURE_WIDTH = 6  # an EAGLE-3 drafter's rows: 3 x the target's hidden size
CHILD_TIMEOUT_S = 60  # each child's process-group timeout: a dead peer turns into an error, not a hang
PARENT_TIMEOUT_S = 90


# -- the script every rank rebuilds ----------------------------------------------------------------


@dataclass
class Step:
    plan: bytes
    results: list[Verified]
    draft_ids: list[str]
    windows: dict[str, Drafts]
    features: dict[str, tuple[int, torch.Tensor]]  # verifier rank 0 -> the drafter (EAGLE-3)


def make_window(gen: torch.Generator, length: int) -> Drafts:
    tokens = torch.randint(0, 2**40, (length,), generator=gen).tolist()  # beyond int32 on purpose
    ids = torch.randint(-(2**62), 2**62, (length, SUPPORT), generator=gen)
    probs = torch.rand(length, SUPPORT, generator=gen)
    if length:  # values a lossy path would change: a subnormal and a negative zero
        probs[0, -1], probs[-1, -2] = 1e-45, -0.0
    return Drafts(tokens=tokens, q_ids=list(ids.unbind(0)), q_probs=list(probs.unbind(0)))


def make_step(step: int) -> Step:
    gen = torch.Generator().manual_seed(1000 + step)
    plan = bytes(torch.randint(0, 256, (int(torch.randint(1, 300, (1,), generator=gen)),), generator=gen).tolist())
    if step == 2:
        plan = b""  # an empty plan must round-trip as empty
    result_lengths = [[3, 0, 1, 6, 2], [1], [], [0, 0, 5]][step % 4]
    results = [
        Verified(f"req-{step}-{i}", torch.randint(0, 2**40, (n,), generator=gen).tolist(), max(n - 1, 0), n // 2)
        for i, n in enumerate(result_lengths)
    ]
    # Per draft request: a window length, 0 = a valid empty window, None = dropped.
    window_lengths = [[2, 0, None, 5, 1], [None, None], [0, 0], [3]][step % 4]
    draft_ids = [f"d{step}-{i}" for i in range(len(window_lengths))]
    windows = {r: make_window(gen, n) for r, n in zip(draft_ids, window_lengths) if n is not None}
    dtype = (torch.float32, torch.bfloat16)[step % 2]
    features = {r.request_id: (int(torch.randint(0, 1000, (1,), generator=gen)),
                               torch.randn(len(r.token_ids), FEATURE_WIDTH, generator=gen).to(dtype))
                for r in results if r.token_ids}  # fmt: skip
    return Step(plan, results, draft_ids, windows, features)


def assert_features_equal(got: dict[str, tuple[int, torch.Tensor]], expected: dict[str, tuple[int, torch.Tensor]]):
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    for request_id, (start, rows) in expected.items():
        assert got[request_id][0] == start and got[request_id][1].dtype == rows.dtype
        assert torch.equal(got[request_id][1], rows), request_id


def assert_windows_equal(got: dict[str, Drafts], expected: dict[str, Drafts]) -> None:
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    for request_id, window in expected.items():
        other = got[request_id]
        assert other.tokens == window.tokens, request_id
        assert other.token_probs == []
        assert len(other.q_ids) == len(other.q_probs) == len(window.tokens)
        for mine, theirs in zip(other.q_ids + other.q_probs, window.q_ids + window.q_probs):
            assert mine.device.type == "cpu" and mine.shape == (SUPPORT,) and mine.dtype == theirs.dtype
            bits = torch.int64 if mine.dtype == torch.int64 else torch.int32
            assert torch.equal(mine.view(bits), theirs.view(bits)), request_id  # bit-exact, NaN-safe


# -- the ranks -------------------------------------------------------------------------------------


def play(rank: int, tp_size: int, channel: StepChannel) -> int:
    """One rank's side of every step, in the real step-end order; returns how many transfers it checked."""
    checked = 0
    for step in range(NUM_STEPS):
        s = make_step(step)
        verify_ids = [r.request_id for r in s.results]
        if rank == tp_size:  # the drafter
            assert channel.recv_results(verify_ids) == s.results
            assert_features_equal(channel.recv_features(verify_ids), s.features)
            channel.send_drafts(s.draft_ids, s.windows)
            checked += 2
            continue
        if rank == 0:
            assert channel.broadcast_plan(s.plan) == s.plan
            channel.send_results(s.results)
            channel.send_features(verify_ids, s.features, FEATURE_WIDTH)
        else:
            assert channel.broadcast_plan(None) == s.plan
            assert channel.recv_results(verify_ids) == s.results
            checked += 2
        assert_windows_equal(channel.recv_drafts(s.draft_ids), s.windows)
        checked += 1
    return checked + check_order_mismatch(rank, tp_size, channel)


def check_order_mismatch(rank: int, tp_size: int, channel: StepChannel) -> int:
    """Receivers that expect another order fail clearly. No payload follows (empty windows only), so
    the failed receive leaves nothing in flight."""
    ids = ["a", "b"]
    if rank == tp_size:
        # Bad windows are refused before anything is sent, so the peers see nothing of them.
        with pytest.raises(ValueError, match="not in this transfer"):
            channel.send_drafts(ids, {"c": Drafts()})
        with pytest.raises(ValueError, match="one q_ids and one q_probs row"):
            channel.send_drafts(ids, {"a": Drafts(tokens=[1])})
        with pytest.raises(ValueError, match="entries each"):
            channel.send_drafts(ids, {"a": Drafts([1], [], [torch.zeros(3, dtype=torch.long)], [torch.zeros(3)])})
        channel.send_drafts(ids, {"a": Drafts()})
        return 0
    with_error = None
    try:
        channel.recv_drafts(ids[::-1])
    except ValueError as exc:
        with_error = str(exc)
    assert with_error is not None and "another order" in with_error, with_error
    return 1


def child(rank: int, tp_size: int, port: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    try:
        groups = init_world(
            rank=rank,
            topology=Topology(tp_size, has_drafter=True),
            master_addr="127.0.0.1",
            master_port=port,
            timeout_s=CHILD_TIMEOUT_S,
        )
        assert groups.backend == "gloo" and groups.device == torch.device("cpu")
        assert groups.is_drafter == (rank == tp_size) and (groups.tp_group is None) == groups.is_drafter
        checked = play(rank, tp_size, StepChannel(groups, SUPPORT))
        torch.distributed.barrier()  # rank 0 hosts the store: nobody leaves before everyone is done
        groups.close()
        groups.close()  # idempotent
        results.put((rank, "ok", checked))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


def run_world(tp_size: int) -> dict[int, int]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    world = tp_size + 1
    procs = [ctx.Process(target=child, args=(rank, tp_size, port, results), daemon=True) for rank in range(world)]
    for proc in procs:
        proc.start()
    reports: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + PARENT_TIMEOUT_S
    try:
        while len(reports) < world:
            try:
                rank, status, detail = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                rank = None
            if rank is None:  # failing outside the except keeps the report free of the queue's traceback
                pytest.fail(f"timed out; ranks {sorted(set(range(world)) - reports.keys())} never reported")
            if status == "error":
                pytest.fail(f"rank {rank} failed:\n{detail}")
            reports[rank] = (status, detail)
        for proc in procs:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
        assert [p.exitcode for p in procs] == [0] * world
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return {rank: detail for rank, (_, detail) in reports.items()}  # type: ignore[misc]


def reformer(rank: int, port: int, results: mp.Queue) -> None:
    """Rank 1 first fails a formation inside the process group's rendezvous (rank 0 is not there: a hung
    peer), then both form the next epoch's world through the same store."""
    torch.set_num_threads(1)
    try:
        store = rendezvous_store("127.0.0.1", port, is_master=rank == 0, timeout_s=30)
        if rank == 1:
            prefixed = torch.distributed.PrefixStore("minedraft/epoch/1/", store)
            try:
                torch.distributed.init_process_group("gloo", store=prefixed, rank=1, world_size=2,
                                                     timeout=timedelta(seconds=2))  # fmt: skip
                raise AssertionError("a world of two formed with one rank")
            except (RuntimeError, torch.distributed.DistError):
                store.set("failed", "1")
        store.wait(["failed"])
        groups = init_world(rank=rank, topology=Topology(1, has_drafter=True), master_addr="127.0.0.1",
                            master_port=port, timeout_s=20, store=store, epoch=2)  # fmt: skip
        torch.distributed.barrier()
        groups.close()
        results.put((rank, "ok", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


def test_a_world_forms_again_after_a_formation_failed_on_one_rank():
    """torch names the default group by a count of the groups a process made, and a failed formation raised it
    on the rank where it failed: the next formation then met under keys the other rank never wrote."""
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=reformer, args=(rank, port, results), daemon=True) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        reports = [results.get(timeout=PARENT_TIMEOUT_S) for _ in procs]
        assert sorted((rank, status) for rank, status, _ in reports) == [(0, "ok"), (1, "ok")], reports
        for proc in procs:
            proc.join(timeout=30)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


@pytest.mark.parametrize("tp_size", [2, 1])
def test_step_transfers_across_processes(tp_size):
    checked = run_world(tp_size)
    per_follower = 3 * NUM_STEPS + 1  # plan, results, drafts per step + the order mismatch
    # the drafter: results and features, per step
    expected = {0: NUM_STEPS + 1, **{r: per_follower for r in range(1, tp_size)}, tp_size: 2 * NUM_STEPS}
    assert checked == expected


# -- in one process ----------------------------------------------------------------------------------


def test_topology():
    topo = Topology(2, has_drafter=True)
    assert (topo.world_size, topo.drafter_rank, list(topo.verifier_ranks)) == (3, 2, [0, 1])
    assert Topology(4, has_drafter=False).world_size == 4
    with pytest.raises(ValueError, match="no drafter"):
        _ = Topology(1, has_drafter=False).drafter_rank
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tp_size must be a positive integer"):
            Topology(bad, has_drafter=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"rank": 3}, ValueError, r"rank 3 is outside the world of 3 \(2 verifier rank\(s\) \+ 1 drafter\)"),
        ({"rank": -1}, ValueError, "valid ranks are 0..2"),
        ({"rank": "0"}, TypeError, "rank must be an int"),
        ({"master_addr": ""}, ValueError, "master_addr is empty"),
        ({"master_port": 0}, ValueError, "master_port must be an int in 1..65535"),
        ({"backend": "mpi"}, ValueError, "backend must be 'nccl', 'gloo' or None"),
        ({"timeout_s": 0}, ValueError, "timeout_s must be positive"),
        ({"topology": (2, True)}, TypeError, "topology must be a Topology"),
        ({"device": "not-a-device"}, ValueError, "not a device"),
    ],
)
def test_init_world_rejects_bad_arguments(kwargs, error, message):
    args = {"rank": 0, "topology": Topology(2, has_drafter=True), "master_addr": "127.0.0.1", "master_port": 29500}
    with pytest.raises(error, match=message):
        init_world(**(args | kwargs))


def test_backend_choice():
    assert pick_backend("cpu") == "gloo"
    if not torch.cuda.is_available():
        assert pick_backend("cuda") == "gloo"
    gpu = lambda key: (None, "nccl", key)  # noqa: E731
    cpu = (None, "gloo", "")
    assert agree_backend([gpu("h/0"), gpu("h/1")]) == "nccl"
    assert agree_backend([gpu("h/0"), gpu("h/0")]) == "gloo"  # two ranks on one GPU: NCCL would refuse
    assert agree_backend([gpu("h/0"), cpu]) == "gloo"
    assert agree_backend([("gloo", "nccl", "h/0"), ("gloo", "nccl", "h/1")]) == "gloo"
    with pytest.raises(ValueError, match="rank\\(s\\) \\[1\\] are not"):
        agree_backend([("nccl", "nccl", "h/0"), ("nccl", "gloo", "")])
    with pytest.raises(ValueError, match="share a GPU"):
        agree_backend([("nccl", "nccl", "h/0"), ("nccl", "nccl", "h/0")])
    with pytest.raises(ValueError, match="different backends"):
        agree_backend([("nccl", "nccl", "h/0"), ("gloo", "nccl", "h/1")])


def test_single_verifier_world_and_misuse():
    """tp=1 without a drafter: the TP group is the world, plan forwarding and results are local no-ops."""
    groups = init_world(
        rank=0, topology=Topology(1, has_drafter=False), master_addr="127.0.0.1", master_port=free_port(), timeout_s=10
    )
    try:
        assert (groups.backend, groups.tp_rank, groups.is_verifier, groups.is_drafter) == ("gloo", 0, True, False)
        with pytest.raises(RuntimeError, match="already exists"):
            init_world(rank=0, topology=Topology(1, has_drafter=False), master_addr="127.0.0.1", master_port=1)
        channel = StepChannel(groups, SUPPORT)
        assert channel.broadcast_plan(b"plan") == b"plan"
        channel.send_results([Verified("a", [1, 2], 1, 1)])  # nobody to send to
        with pytest.raises(ValueError, match="must pass the plan bytes"):
            channel.broadcast_plan(None)
        with pytest.raises(RuntimeError, match="calls send_results"):
            channel.recv_results(["a"])
        with pytest.raises(RuntimeError, match="only the drafter sends drafts"):
            channel.send_drafts(["a"], {})
        with pytest.raises(ValueError, match="support_size"):
            StepChannel(groups, 0)
    finally:
        groups.close()
        groups.close()
    assert not torch.distributed.is_initialized()


def test_ids_hash_depends_on_order_and_boundaries():
    assert ids_hash(["a", "b"]) != ids_hash(["b", "a"])
    assert ids_hash(["ab", "c"]) != ids_hash(["a", "bc"])
    assert ids_hash([]) == ids_hash([])
