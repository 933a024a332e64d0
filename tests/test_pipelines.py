"""The step schedules of `engine/pipelines.py` as tables: no models, no torch, milliseconds.

Each row is one step: which requests were admitted, which were drafted (`a:3` = three draft tokens,
`a:3+` = a PEARL continuation drafted on after the window being verified) and which were verified
(`a~` = verified without the bonus token, because the drafter continues it). Between steps the harness
does what the engine does at a step's end, with every draft accepted unless the table rejects it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from minedraft.config import EngineConfig
from minedraft.engine.pipelines import make_pipeline
from minedraft.engine.plans import DraftPlan, VerifyPlan
from minedraft.engine.request import Request
from minedraft.sampling.params import SamplingParams

# The fixed schedules (adaptive speculation chooses among their shapes: tests/test_step_shapes.py).
SPECS = {
    "ar": None,
    "sd": {"num_speculative_tokens": 3, "adaptive": False},
    "pearl": {"num_speculative_tokens": 3, "is_parallel": True, "force_pearl": True, "adaptive": False},
    "minedraft": {"num_speculative_tokens": 3, "is_parallel": True, "adaptive": False},
    # Adaptive, with nothing measured yet: one-batch steps at k (overlap where a seeded request keeps the mode's own).
    "sd-adaptive": {"num_speculative_tokens": 3},
    "minedraft-adaptive": {"num_speculative_tokens": 3, "is_parallel": True},
}


class Letters:
    """A decoder for the requests' text: token i is one letter (the schedules never look at text)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _request(request_id: str, max_tokens: int) -> Request:
    """Requests whose id starts with "s" sample with a seed; the others are greedy."""
    seeded = request_id.startswith("s")
    params = SamplingParams(temperature=1.0 if seeded else 0, seed=7 if seeded else None, max_tokens=max_tokens,
                            ignore_eos=True)  # fmt: skip
    return Request.create(
        request_id, [1, 2], params, seed=0, max_model_len=1000, eos_token_ids=frozenset(), tokenizer=Letters()
    )


def _describe(admitted: list[Request], draft: DraftPlan | None, verify: VerifyPlan | None) -> str:
    admit = ",".join(r.request_id for r in admitted) or "-"
    drafts = ",".join(f"{t.request_id}:{t.num_tokens}{'+' * t.continue_window}" for t in draft.tasks) if draft else "-"
    drafts += " after" if draft and draft.after_verify else ""  # drafted after this step's verification
    verified = ",".join(f"{t.request_id}{'~' * (not t.keep_bonus)}" for t in verify.tasks) if verify else "-"
    return f"admit {admit} | draft {drafts} | verify {verified}"


def _step_end(requests: dict[str, Request], draft: DraftPlan | None, verify: VerifyPlan | None, rejected: set) -> None:
    """The engine's bookkeeping: verified requests get their tokens, drafted ones hold a new window (a PEARL
    continuation only when the window it continued was accepted in full)."""
    for task in verify.tasks if verify else []:
        request = requests[task.request_id]
        held = request.pending_drafts or 0
        accepted = 0 if task.request_id in rejected else held
        bonus = accepted < held or task.keep_bonus
        request.pending_drafts = None
        request.append_tokens([3] * (accepted + bonus))
    for task in draft.tasks if draft else []:
        if not (task.continue_window and task.request_id in rejected):
            requests[task.request_id].pending_drafts = task.num_tokens


def simulate(
    mode: str,
    arrivals: dict[int, list[str]],
    steps: int,
    *,
    max_tokens: dict[str, int] | None = None,
    rejected: dict[int, set[str]] | None = None,
    max_num_seqs: int = 2,
) -> list[str]:
    pipeline = make_pipeline(EngineConfig(speculative_config=SPECS[mode], max_num_seqs=max_num_seqs))
    requests: dict[str, Request] = {}
    rows = []
    for step in range(steps):
        for request_id in arrivals.get(step, []):
            requests[request_id] = _request(request_id, (max_tokens or {}).get(request_id, 100))
            pipeline.batches.add(requests[request_id])
        admitted, draft, verify = pipeline.schedule()
        rows.append(_describe(admitted, draft, verify))
        _step_end(requests, draft, verify, (rejected or {}).get(step, set()))
        pipeline.batches.remove_finished()
    return rows


TABLES = {
    "ar: every step verifies the whole batch with no drafts; the third request waits for room": (
        "ar", {0: ["a", "b", "c"]}, 3, {"a": 2}, {}, [
            "admit a,b | draft - | verify a,b",
            "admit - | draft - | verify a,b",  # a finishes here (2 tokens)
            "admit c | draft - | verify b,c",
        ],
    ),
    "sd: draft the batch, then each step verifies its windows and drafts the next ones after them": (
        "sd", {0: ["a", "b"]}, 4, {}, {}, [
            "admit a,b | draft a:3,b:3 | verify -",
            "admit - | draft a:3,b:3 after | verify a,b",
            "admit - | draft a:3,b:3 after | verify a,b",
            "admit - | draft a:3,b:3 after | verify a,b",
        ],
    ),
    "minedraft: draft batch 0, then draft batch 1 while batch 0 is verified, then swap": (
        "minedraft", {0: ["a", "b", "c"]}, 4, {}, {}, [
            "admit a,b,c | draft a:3,c:3 | verify -",  # before decoding: each to the smaller batch
            "admit - | draft b:3 | verify a,c",
            "admit - | draft a:3,c:3 | verify b",
            "admit - | draft b:3 | verify a,c",
        ],
    ),
    "minedraft: once decoding runs, a new request joins the batch drafted next": (
        "minedraft", {0: ["a", "b"], 2: ["c"], 3: ["d"]}, 5, {}, {}, [
            "admit a,b | draft a:3 | verify -",
            "admit - | draft b:3 | verify a",
            "admit c | draft a:3,c:3 | verify b",  # step 2 drafts batch 0
            "admit d | draft b:3,d:3 | verify a,c",  # step 3 drafts batch 1; c's first window is verified
            "admit - | draft a:3,c:3 | verify b,d",
        ],
    ),
    "minedraft with one batch empty degrades to standard sd, never a deadlock": (
        "minedraft", {0: ["a"]}, 4, {}, {}, [
            "admit a | draft a:3 | verify -",
            "admit - | draft - | verify a",
            "admit - | draft a:3 | verify -",
            "admit - | draft - | verify a",
        ],
    ),
    "drafts stop one short of the request's last token (the verification adds one of its own)": (
        "minedraft", {0: ["a", "b"]}, 4, {"a": 3, "b": 6}, {}, [
            "admit a,b | draft a:2 | verify -",
            "admit - | draft b:3 | verify a",  # a gets 2 drafts + 1 bonus = 3 tokens: done
            "admit - | draft - | verify b",
            "admit - | draft b:1 | verify -",  # b holds 4 of 6: one draft + the bonus finish it
        ],
    ),
    "adaptive sd: a step that starts a request decodes its first token, then drafts after it": (
        "minedraft-adaptive", {0: ["a", "b"], 2: ["c"]}, 3, {}, {}, [
            "admit a,b | draft a:3,b:3 after | verify a,b",
            "admit - | draft a:3,b:3 after | verify a,b",
            "admit c | draft a:3,c:3,b:3 after | verify a,b,c",  # c's first token beside a's and b's windows
        ],
    ),
    "adaptive, a seeded request: never decoded before its first window, wherever its steps fall": (
        "sd-adaptive", {0: ["a", "s"]}, 2, {}, {}, [
            "admit a,s | draft a:3,s:3 after | verify a",
            "admit - | draft a:3,s:3 after | verify a,s",
        ],
    ),
    "adaptive overlap (a seeded request keeps it): the other batch decodes beside the first drafting": (
        "minedraft-adaptive", {0: ["a", "b", "s"]}, 3, {}, {}, [
            "admit a,b,s | draft a:3,s:3 | verify b",
            "admit - | draft b:3 | verify a,s",
            "admit - | draft a:3,s:3 | verify b",
        ],
    ),
    "pearl: verify a window while drafting its continuation; keep it when the window is accepted in full": (
        "pearl", {0: ["a", "b"]}, 4, {}, {2: {"b"}}, [
            "admit a,b | draft a:3,b:3 | verify -",
            "admit - | draft a:3+,b:3+ | verify a~,b~",
            "admit - | draft a:3+,b:3+ | verify a~,b~",  # b's window is rejected: its continuation is dropped
            "admit - | draft a:3+,b:3 | verify a~",  # b drafts afresh from the correction, unverified
        ],
    ),
}


@pytest.mark.parametrize("case", list(TABLES))
def test_step_schedule(case: str) -> None:
    mode, arrivals, steps, max_tokens, rejected, expected = TABLES[case]
    assert simulate(mode, arrivals, steps, max_tokens=max_tokens, rejected=rejected) == expected


def test_minedraft_runs_twice_max_num_seqs() -> None:
    rows = simulate("minedraft", {0: list("abcde")}, 1)
    assert rows == ["admit a,b,c,d | draft a:3,c:3 | verify -"]  # e waits: 2 batches x 2


def test_the_schedules_import_no_torch() -> None:
    code = "import sys, minedraft.engine.pipelines; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize("mode", ["sd", "pearl", "minedraft"])
def test_a_step_always_has_work_while_requests_run_or_wait(mode: str) -> None:
    """Requests that come and go at every step parity: no step is empty while one runs or waits (an empty plan
    let the service's loop sleep until its next command: a half-second stall before a first token)."""
    arrivals = {0: ["a"], 3: ["b"], 4: ["c"], 9: ["d"], 12: ["e", "f"], 17: ["g"]}
    max_tokens = {"a": 2, "b": 3, "c": 1, "d": 4, "e": 2, "f": 5, "g": 3}
    pipeline = make_pipeline(EngineConfig(speculative_config=SPECS[mode], max_num_seqs=2))
    requests: dict[str, Request] = {}
    for step in range(24):
        for request_id in arrivals.get(step, []):
            requests[request_id] = _request(request_id, max_tokens[request_id])
            pipeline.batches.add(requests[request_id])
        busy = bool(pipeline.batches.waiting) or any(pipeline.batches.batches)
        admitted, draft, verify = pipeline.schedule()
        row = _describe(admitted, draft, verify)
        has_work = bool(draft and draft.tasks) or bool(verify and verify.tasks)
        assert has_work == busy, f"step {step}: {row}"
        _step_end(requests, draft, verify, set())
        pipeline.batches.remove_finished()


def test_requests_know_what_the_drafter_has_read_of_them() -> None:
    """A request's `drafter_tokens` (what adaptive speculation weighs a turn to speculation by): 0 from admission,
    its whole length once a step drafts it, 0 again when it is admitted afresh (after a preemption)."""
    pipeline = make_pipeline(EngineConfig(speculative_config=SPECS["sd"], max_num_seqs=2))
    requests = {"a": _request("a", 100)}
    pipeline.batches.add(requests["a"])
    _, draft, verify = pipeline.schedule()
    assert [t.request_id for t in draft.tasks] == ["a"] and requests["a"].drafter_tokens == 2  # its prompt
    _step_end(requests, draft, verify, set())
    for _ in range(2):  # a step that verifies the window and drafts after it, then the next one's plan
        _, draft, verify = pipeline.schedule()
        _step_end(requests, draft, verify, set())
    # As of the last plan: the first window's 3 drafts and bonus token (the drafter reads each step's own
    # verified tokens as it drafts after them; the catch-up weighed is what goes beyond that)
    assert requests["a"].drafter_tokens == 2 + 4
    pipeline.batches.batches[0].remove(requests["a"])
    pipeline.batches.add(requests["a"])
    pipeline.batches.admit_into(0)
    assert requests["a"].drafter_tokens == 0
