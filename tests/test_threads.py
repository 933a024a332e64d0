"""How a worker picks its torch thread count per kind of step (`engine/adaptive/threads.py`): a share beside the
other part, the fastest count measured alone, trials that settle, and the in-process engine doing the same."""

from collections import Counter

import torch

from minedraft.config import EngineConfig
from minedraft.engine.adaptive.threads import StepKind, StepThreads, ThreadCounts
from minedraft.engine.engine import LLMEngine
from minedraft.sampling.params import SamplingParams


def test_a_worker_takes_its_share_beside_the_other_and_the_fastest_count_alone() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        assert StepThreads("cuda", beside=1).beside == 4  # a GPU worker's host threads are left alone
        clock = [0.0]
        threads = StepThreads("cpu", beside=1, clock=lambda: clock[0])
        threads.use(together=True)
        assert torch.get_num_threads() == 1
        # This machine: a step's forward is fastest on 4 threads, but with 2 the next step starts soonest (the
        # scheduler and the clients keep their share of the cores): the cycle decides.
        forward, cycle = {1: 3e-3, 2: 2.5e-3, 4: 2e-3}, {1: 3.5e-3, 2: 3e-3, 4: 4.5e-3}
        for _ in range(20):
            threads.use(together=False, requests=1)
            # A part on a count not measured yet, or other than the best known, is a try of that count (its step
            # says so: the engine does not judge the step's shape by it).
            count, kind = torch.get_num_threads(), StepKind("", 1, 0, False)
            measured = threads._counts._trials.costs().get(kind, {})
            assert threads.trying == (count not in measured or count != threads._counts.best(kind))
            threads.done(forward[torch.get_num_threads()])
            clock[0] += cycle[torch.get_num_threads()]
        threads.use(together=False, requests=1)
        assert torch.get_num_threads() == 2 and not threads.trying
        threads.use(together=True)
        assert not threads.trying
        threads.use(together=False, requests=1)
        threads.done(forward[2])
        clock[0] += 1.0  # idle: no request for a second, which is not the step's
        threads.use(together=False, requests=1)
        assert threads._counts.best(StepKind("", 1, 0, False)) == 2
    finally:
        torch.set_num_threads(before)


def test_parts_of_one_size_that_cost_differently_are_timed_apart() -> None:
    """A verifier that drafts too runs draft parts, verifications of windows and plain steps at the same number of
    requests, by turns. Here plain steps are fastest on 2 threads and the draft parts on 1: each gets its own."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        clock = [0.0]
        threads = StepThreads("cpu", beside=0, clock=lambda: clock[0])
        cycle = {"plain": {1: 9e-3, 2: 6e-3}, "draft": {1: 5e-3, 2: 8e-3}}
        for step in range(600):
            part = "plain" if step % 3 else "draft"
            threads.use(together=False, requests=8, part=part)
            seconds = cycle[part][torch.get_num_threads()]
            threads.done(seconds)
            clock[0] += seconds
        assert threads._counts.best(StepKind("plain", 4, 0, False)) == 2
        assert threads._counts.best(StepKind("draft", 4, 0, False)) == 1
    finally:
        torch.set_num_threads(before)


def test_verifications_of_different_windows_are_timed_apart() -> None:
    """Adaptive k changes a request's window from step to step, for runs of steps: one request verified with a
    window of 1 runs fastest on one thread here, with a window of 4 on two. Counts tried while the windows were
    short must not be compared with counts tried while they were long: each window size gets its own count."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        clock = [0.0]
        threads = StepThreads("cpu", beside=0, clock=lambda: clock[0])
        cycle = {2: {1: 3.0e-3, 2: 3.4e-3}, 5: {1: 5.0e-3, 2: 3.8e-3}}  # tokens fed -> threads -> seconds
        picked: dict[int, Counter[int]] = {2: Counter(), 5: Counter()}
        for step in range(1200):
            tokens = 2 if (step // 40) % 2 else 5  # runs of 40 steps of each window
            threads.use(together=False, requests=1, part="verify", tokens=tokens)
            count = torch.get_num_threads()
            if step >= 600:
                picked[tokens][count] += 1
            threads.done(cycle[tokens][count])
            clock[0] += cycle[tokens][count]
        assert picked[2][1] >= 0.9 * picked[2].total() and picked[5][2] >= 0.9 * picked[5].total(), picked
    finally:
        torch.set_num_threads(before)


class Cores:
    """A machine where a step's time is its count's steady cycle, except the first steps after a change of count,
    which carry what the steps before did to the other processes (a backlog: 5 ms more)."""

    def __init__(self, counts: ThreadCounts) -> None:
        self.counts, self.last, self.streak = counts, 0, 0

    def run(self, kind: StepKind, seconds: dict[int, float], steps: int, gap_every: int = 0) -> Counter[int]:
        """`gap_every`: every so many steps one waits 6 ms more for the client (its next request)."""
        picked: Counter[int] = Counter()
        for step in range(steps):
            count = self.counts.pick(kind)
            self.streak = self.streak + 1 if count == self.last else 1
            self.last = count
            picked[count] += 1
            gap = 6e-3 if gap_every and step % gap_every == gap_every - 1 else 0.0
            self.counts.add(kind, count, seconds[count] + (5e-3 if self.streak <= 2 else 0.0) + gap)
        return picked


def test_thread_counts_follow_the_machine_per_kind_of_step() -> None:
    counts = ThreadCounts(2)
    cores = Cores(counts)
    one, many = StepKind("", 1, 0, False), StepKind("", 6, 0, False)  # one request a step; 32-63 a step
    cores.run(one, {1: 6e-3, 2: 3e-3}, 300)  # a quiet machine: both threads win
    assert counts.best(one) == 2
    # Served at one request (the scheduler and the clients on the same cores): one thread wins, though a step of
    # one thread after steps of two takes 8.5 ms, longer than a step of two (4.3): only settled runs count.
    cores.run(one, {1: 3.5e-3, 2: 4.3e-3}, 1024)
    assert counts.best(one) == 1
    picked = cores.run(one, {1: 3.5e-3, 2: 4.3e-3}, 1024)
    assert picked[2] <= 6 * (1024 // 256)  # settled: one run of the other count per probe
    cores.run(many, {1: 9e-3, 2: 6e-3}, 64)  # a batch of 40: both threads win, its own choice
    assert counts.best(many) == 2 and counts.best(one) == 1


def test_a_cycle_that_waited_for_a_client_does_not_decide_the_thread_count() -> None:
    """Served at one request: every 11th step waits 6 ms for the client's next request. One thread's steps are
    1.7 ms, two threads' 2.0: one thread wins and stays, though a wait that lands in a trial's four steps makes
    their mean the slower."""
    counts = ThreadCounts(2)
    cores = Cores(counts)
    one = StepKind("", 1, 0, False)
    cores.run(one, {1: 1.7e-3, 2: 2.0e-3}, 256, gap_every=11)
    assert counts.best(one) == 1
    picked = cores.run(one, {1: 1.7e-3, 2: 2.0e-3}, 2048, gap_every=11)
    assert picked[1] >= 0.95 * picked.total(), picked


def test_a_step_larger_than_one_where_every_thread_won_is_not_tried_on_fewer() -> None:
    """Once plain steps of 31 requests measured two threads fastest, a verification that reads 31 prompts (more
    tokens, a kind seen once in a while) runs on two from its first step and is never tried on one; a kind of
    another part, or of more requests, is tried as before, and so is the large kind again once the small one
    measures one thread fastest (a neighbour came)."""
    counts = ThreadCounts(2)
    cores = Cores(counts)
    small, large = StepKind("plain", 5, 5, False), StepKind("verify", 5, 13, False)
    cores.run(small, {1: 9e-3, 2: 6e-3}, 64)
    assert counts.best(small) == 2
    assert cores.run(large, {1: 0.6, 2: 0.4}, 64) == Counter({2: 64})
    assert 1 in cores.run(StepKind("draft", 5, 13, False), {1: 0.06, 2: 0.04}, 64)
    assert 1 in cores.run(StepKind("verify", 6, 13, False), {1: 0.06, 2: 0.04}, 64)
    cores.run(small, {1: 9e-3, 2: 18e-3}, 2048)
    assert counts.best(small) == 1
    assert 1 in cores.run(large, {1: 0.3, 2: 0.4}, 64)


def test_a_step_that_reads_prompts_runs_on_every_thread() -> None:
    """Served, plain steps of 31 requests measured one thread fastest (the clients share the cores); a wave of 31
    new prompts read in one verification is another kind, hundreds of tokens a parallel region, and runs on both
    threads from its first step, untried on one."""
    counts = ThreadCounts(2)
    cores = Cores(counts)
    decoding, wave = StepKind("plain", 5, 5, False), StepKind("plain", 5, 13, True)
    cores.run(decoding, {1: 6e-3, 2: 9e-3}, 64)
    assert counts.best(decoding) == 1
    assert cores.run(wave, {1: 0.7, 2: 0.4}, 12) == Counter({2: 12})


def test_the_in_process_engine_times_the_parts_it_runs_alone_by_thread_count(pair) -> None:
    """The offline engine (and a verifier that drafts itself, which runs the same executor) tries each kind of
    part it runs alone on each thread count and keeps the fastest, as a lone served worker does: beside a busy
    neighbour a forward on both cores of a 2-core CPU waits at every parallel region for the thread that shares
    its core, and offline plain decoding kept a third of its quiet speed there. The count changes no output."""
    target, draft = pair
    prompts, params = [[5, 6, 7, 8], [9, 10, 11]], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outputs, before = {}, torch.get_num_threads()
    torch.set_num_threads(2)  # the tests' processes run on one thread
    try:
        for name, spec in (("ar", None), ("sd", {"model": draft, "adaptive": False})):
            engine = LLMEngine.local(EngineConfig(model=target, device="cpu", max_num_seqs=2, speculative_config=spec))
            requests = [engine.add_request(p, params) for p in prompts]
            tried = 0
            while engine.has_unfinished():
                engine.step()
                tried += engine.last_step.thread_trial
            outputs[name] = [r.output_ids for r in requests]
            assert torch.get_num_threads() == 2, "idle, the engine gives the process back its threads"
            counts = engine.executor.threads._counts
            if name == "ar":  # one kind of decoding step (2 requests, 1 token each): a run of tries on each count
                assert tried >= 2 * ThreadCounts._RUN, "the first steps of a kind run on the counts being tried"
            else:
                assert tried > 0 and "verify+draft" in {kind.part for kind in counts._runs}, (
                    "a one-batch step is a kind of its own")
    finally:
        torch.set_num_threads(before)
    assert outputs["sd"] == outputs["ar"]
