"""The drafter's worker: proposes draft windows with the small model (or from a request's prediction) and hands
them over at the step's end."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from minedraft.config import LoraModule
from minedraft.engine.plans import DraftPlan, Drafts, DraftTask, Verified
from minedraft.engine.workers.base import _Worker, point_mass
from minedraft.engine.workers.sequence import _Sequence
from minedraft.model.runner import ModelRunner, SeqInput
from minedraft.sampling.sampler import draft_sample, greedy_layout
from minedraft.sampling.streams import DRAFT, seed_tensor, uniforms
from minedraft.sampling.tetris import tetris_select


class DraftWorker(_Worker):
    """Proposes draft windows with the small model and hands them over at the step's end.

    With a mask token (PARD) a window takes one forward over [pending tokens, mask x (k - 1)]; without, k
    forwards of one token each.
    """

    def __init__(self, runner: ModelRunner, support_size: int, mask_token: int | None = None) -> None:
        super().__init__(runner)
        self.support_size = support_size
        self.mask_token = mask_token
        self.max_seq_len = runner.max_seq_len if runner is not None else 0
        self._windows: dict[str, tuple[list[int], Drafts]] = {}  # request -> (base it continues, drafts)
        self._handed: dict[str, list[int]] = {}  # request -> draft tokens the verifier holds now

    def _adapter_folder(self, module: LoraModule) -> str | None:
        return module.draft_path  # none: the draft model drafts that domain with its base weights

    def _adapter(self, name: str | None) -> str | None:
        """The drafter adapter of a request's domain where the draft model has one, else its base weights:
        whatever it drafts, the target verifies with its own adapter."""
        return name if self.runner.serves_lora(name) else None

    def release(self, request_ids: list[str]) -> None:
        super().release(request_ids)
        for request_id in request_ids:
            self._windows.pop(request_id, None)
            self._handed.pop(request_id, None)

    def draft(self, plan: DraftPlan) -> None:
        """Draft every task's window: from its prediction where that has tokens to propose, else with the model
        (all its requests batched in each forward)."""
        plan = replace(plan, tasks=[self._within_capacity(t) for t in plan.tasks])
        looked_up = self._look_up([t for t in plan.tasks if t.num_tokens > 0])
        self._draft_with_model(replace(plan, tasks=[t for t in plan.tasks if t.request_id not in looked_up]))
        for task in plan.tasks:
            if task.request_id in looked_up:
                self._windows[task.request_id] = (self._base(task), looked_up[task.request_id])

    def _look_up(self, tasks: list[DraftTask]) -> dict[str, Drafts]:
        """The windows proposed without the model: each task's prediction's next tokens, where it has any."""
        windows = {}
        for task in tasks:
            prediction = self._predictions.get(task.request_id)
            if prediction is not None:
                handed = self._handed.get(task.request_id, []) if task.continue_window else []
                tokens = prediction.propose(task.num_tokens, handed)
                if tokens:
                    windows[task.request_id] = point_mass(tokens, self.support_size)
        return windows

    def _draft_with_model(self, plan: DraftPlan) -> None:
        """Draft the plan's windows with the draft model (and read its prefill chunks)."""
        tasks = [t for t in plan.tasks if t.num_tokens > 0]
        seqs = [self.sequences[t.request_id] for t in tasks]
        bases = [self._base(t) for t in tasks]
        prefill = self._prefill_inputs(plan.prefill)  # rides along with the (first) draft forward
        if not tasks:
            drafts = []
            if prefill:
                self.runner.forward(prefill)
        elif self.mask_token is None:
            drafts = self._draft_token_by_token(tasks, seqs, bases, prefill)
        else:
            drafts = self._draft_in_one_forward(tasks, seqs, bases, prefill)
        self._prefilled(plan.prefill)
        if plan.tetris_capacity is not None and drafts:
            keep = tetris_select([d.token_probs for d in drafts], plan.tetris_capacity)
            for d, n in zip(drafts, keep):
                d.truncate(n)
        for task, base, window in zip(tasks, bases, drafts):
            self._windows[task.request_id] = (base, window)
        for task in plan.tasks:
            if task.num_tokens <= 0:  # nothing to draft: the verifier will decode one token plainly
                self._windows[task.request_id] = (self._base(task), Drafts())

    def _draft_token_by_token(
        self, tasks: list[DraftTask], seqs: list[_Sequence], bases: list[list[int]], prefill: list[SeqInput]
    ) -> list[Drafts]:
        inputs = [seq.pending(base) for seq, base in zip(seqs, bases)]
        if not prefill and self._plain_greedy(seqs):  # the whole window in one call of the stack, where it runs
            step = [SeqInput(seq.slot, written, start) for seq, (start, written) in zip(seqs, inputs)]
            drafted = self.runner.draft_greedy(step, [t.num_tokens for t in tasks])
            if drafted is not None:
                return self._greedy_drafts(seqs, inputs, *drafted)
        drafts = [Drafts() for _ in tasks]
        num_steps = max(t.num_tokens for t in tasks)
        draws = self._window_draws(seqs, bases, num_steps)
        for step in range(num_steps):
            live = [i for i, t in enumerate(tasks) if t.num_tokens > step]
            chunks = prefill if step == 0 else []
            logits = self.runner.forward([SeqInput(seqs[i].slot, inputs[i][1], inputs[i][0]) for i in live] + chunks)
            rows = ((seqs[i], seqs[i].history(bases[i], drafts[i].tokens)) for i in live)
            logits = self._penalized(logits, seqs, rows)
            tokens, token_probs, q = draft_sample(
                logits, [seqs[i].params for i in live], draws[live, step], self.support_size
            )
            for row, i in enumerate(live):
                start, written = inputs[i]
                seqs[i].kv_tokens[start:] = written
                drafts[i].tokens.append(tokens[row])
                drafts[i].token_probs.append(token_probs[row])
                drafts[i].q_ids.append(q.token_ids[row])
                drafts[i].q_probs.append(q.probs[row])
                inputs[i] = (start + len(written), [tokens[row]])
        return drafts

    @staticmethod
    def _plain_greedy(seqs: list[_Sequence]) -> bool:
        """Whether every request drafts its argmax of the draft model's logits as they are (no penalties nor
        grammar to apply first)."""
        return all(seq.params.greedy and not seq.params.penalized and seq.grammar is None for seq in seqs)

    def _greedy_drafts(self, seqs: list[_Sequence], inputs: list[tuple[int, list[int]]], tokens: list[list[int]],
                       confidence: list[list[float]]) -> list[Drafts]:  # fmt: skip
        """The windows of `ModelRunner.draft_greedy`, as the forward-at-a-time loop builds them: q one-hot on each
        token, and the cache holding the pending tokens and every draft but the last."""
        layout = greedy_layout(torch.tensor([t for row in tokens for t in row]), self.support_size)
        drafts, row = [], 0
        for seq, (start, written), window, probs in zip(seqs, inputs, tokens, confidence):
            seq.kv_tokens[start:] = written + window[:-1]
            rows = slice(row, row + len(window))
            drafts.append(Drafts(window, probs, list(layout.token_ids[rows]), list(layout.probs[rows])))
            row += len(window)
        return drafts

    def _draft_in_one_forward(
        self, tasks: list[DraftTask], seqs: list[_Sequence], bases: list[list[int]], prefill: list[SeqInput]
    ) -> list[Drafts]:
        """PARD: position j of [pending tokens, mask x (k - 1)] predicts the window's token j + 1. Each token
        is drawn from its own position's q (not conditioned on the drafts before it), which the rejection rule
        allows like any other q. The masks' KV is not recorded: the next forward writes over it."""
        widths = [t.num_tokens for t in tasks]
        inputs = [seq.pending(base) for seq, base in zip(seqs, bases)]
        logits = self.runner.forward(
            [
                SeqInput(seq.slot, written + [self.mask_token] * (n - 1), start, num_logits=n)
                for seq, (start, written), n in zip(seqs, inputs, widths)
            ]
            + prefill
        )
        draws = self._window_draws(seqs, bases, max(widths))
        # Each position's q is drawn without the drafts before it, so it is processed with the window's base.
        rows = ((seq, seq.history(base)) for seq, base, n in zip(seqs, bases, widths) for _ in range(n))
        logits = self._penalized(logits, seqs, rows)
        params = [seq.params for seq, n in zip(seqs, widths) for _ in range(n)]
        row_draws = torch.cat([draws[i, :n] for i, n in enumerate(widths)])
        tokens, token_probs, q = draft_sample(logits, params, row_draws, self.support_size)
        drafts, row = [], 0
        for seq, (start, written), n in zip(seqs, inputs, widths):
            seq.kv_tokens[start:] = written
            rows = slice(row, row + n)
            drafts.append(Drafts(tokens[rows], token_probs[rows], list(q.token_ids[rows]), list(q.probs[rows])))
            row += n
        return drafts

    def _window_draws(self, seqs: list[_Sequence], bases: list[list[int]], width: int) -> torch.Tensor:
        """[tasks, width] uniforms for the whole window at once, keyed by the output position and by where
        the window starts: a window redrafted after a rejection draws afresh, a re-admitted request the same.
        Greedy drafts draw nothing: zeros, without hashing the keys."""
        if all(seq.params.greedy for seq in seqs):
            return torch.zeros(len(seqs), width, device=self.device)
        seeds = seed_tensor([seq.seed for seq in seqs], self.device)[:, None]
        starts = torch.tensor([len(base) for base in bases], dtype=torch.int64, device=self.device)[:, None]
        return uniforms(seeds, DRAFT, starts + torch.arange(width, device=self.device)[None, :], starts)

    def _within_capacity(self, task: DraftTask) -> DraftTask:
        """A plan made ahead of the last results may ask for drafts past a request's end (it finished in the
        step before, or the step's verification ends it): never past what its KV cache can hold, nor past a
        token before the length it stops at (DraftTask.end)."""
        base = len(self._base(task))
        room = self.max_seq_len - base
        if task.end:
            room = min(room, task.end - base - 1)
        room = max(0, room)
        return task if task.num_tokens <= room else replace(task, num_tokens=room)

    def _base(self, task: DraftTask) -> list[int]:
        """The token sequence the task drafts after."""
        tokens = self.sequences[task.request_id].tokens
        return tokens + self._handed.get(task.request_id, []) if task.continue_window else list(tokens)

    def apply_results(self, verified: list[Verified]) -> None:
        for result in verified:
            seq = self.sequences.get(result.request_id)
            if seq is not None:
                seq.tokens.extend(result.token_ids)
                self._follow_prediction(result.request_id, result.token_ids)

    def take_drafts(self, owns: Callable[[str], bool] | None = None) -> dict[str, Drafts]:
        """The windows that are still valid after this step's results (a continuation of a window that
        was not accepted in full is dropped). `owns`: only the requests it says yes to (one group's, in a drafter
        that serves several); the windows the verifier holds are then replaced for those requests alone."""
        mine = [r for r in self._windows if owns is None or owns(r)]
        valid = {}
        for request_id in mine:
            base, window = self._windows.pop(request_id)
            seq = self.sequences.get(request_id)
            if seq is not None and seq.tokens == base:
                valid[request_id] = window
        kept = {} if owns is None else {r: t for r, t in self._handed.items() if not owns(r)}
        self._handed = kept | {request_id: list(window.tokens) for request_id, window in valid.items()}
        return valid
