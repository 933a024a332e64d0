"""The drafter with an EAGLE head of either kind (model/eagle.py): drafts from the target's hidden states.

Head position p takes the token t_{p+1} and a hidden input, so the head can run up to position n - 1
once the target has verified up to t_n and sent its features of positions 0 .. n - 1 (they arrive with
each step's results: `receive_features`; EAGLE-3's are fused by the head's fc on arrival, EAGLE-1's are the
hidden inputs themselves). A window then takes k forwards: the first writes every position
whose features came since the last window (a new request's whole prompt included) and drafts from the
output at n - 1; each next one feeds the drafted token and the head's own output at the position before.

Positions written with the head's own outputs hold guesses: only positions written with the target's
features stay, and the last of them (n - 1) is always written again, since its output starts the window.
A request whose features do not reach n - 1 yet (its first step: the target has not read its prompt) gets
an empty window, which the verifier decodes plainly. Features of positions already written are dropped.

PEARL drafts a window's continuation while the window is verified: it goes on from the window's last
drafted token and the head's output that proposed it (`_tails`), over the window's own positions in the
head's cache, exactly as the window's next step would have.

P-EAGLE (`parallel`, EAGLE-3 heads only): one forward per window. After the window's first input come
k - 1 masked positions (the mask token, and fc of the head's `mask_hidden` as hidden input); row j of the
forward gives draft token j + 1, each from its own q, as PARD does. The masked positions' KV is
overwritten by the next forward, like any drafted position's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minedraft.engine.plans import DraftPlan, Drafts, DraftTask
from minedraft.engine.workers import DraftWorker
from minedraft.engine.workers.sequence import _Sequence
from minedraft.model.eagle import EAGLE3, EagleHead
from minedraft.model.runner import ModelRunner, SeqInput
from minedraft.sampling.sampler import draft_sample
from minedraft.sampling.tetris import tetris_select

Features = dict[str, tuple[int, torch.Tensor]]  # request -> (first position, [rows, width] target features)


@dataclass
class _HeadState:
    written: int = 0  # head positions 0 .. written - 1 hold the target's features (their KV is final)
    start: int = 0  # the position of features' first row (== written)
    features: torch.Tensor | None = None  # hidden inputs (EAGLE-3: fc applied) of positions start .. start + rows - 1

    @property
    def end(self) -> int:
        return self.start + (0 if self.features is None else len(self.features))


class EagleDraftWorker(DraftWorker):
    def __init__(self, runner: ModelRunner, support_size: int, parallel: bool = False) -> None:
        if not isinstance(runner.model, EagleHead):
            raise ValueError(f"{runner.path} is not an EAGLE head")
        if parallel and runner.model.kind != EAGLE3:
            raise ValueError(f"parallel_drafting (P-EAGLE) needs an EAGLE-3 head (method eagle3): {runner.path} is an "
                             "EAGLE-1 head, which drafts token by token")  # fmt: skip
        mask_token = runner.config.pard_token if parallel else None
        if parallel and (runner.model.mask_hidden is None or mask_token is None):
            raise ValueError(f"parallel_drafting with method eagle3 needs a P-EAGLE head: {runner.path} has "
                             f"{'no mask_hidden tensor' if runner.model.mask_hidden is None else 'no mask_token_id'}")
        super().__init__(runner, support_size, mask_token)
        self.head: EagleHead = runner.model
        self._states: dict[str, _HeadState] = {}
        # request -> the input after each drafted token of its last window: (position, token, head output)
        self._tails: dict[str, list[tuple[int, int, torch.Tensor]]] = {}

    def admit(self, admissions) -> None:
        super().admit(admissions)
        for admission in admissions:  # re-admitted: the target sends every position again
            self._states[admission.request_id] = _HeadState()

    def release(self, request_ids: list[str]) -> None:
        super().release(request_ids)
        for request_id in request_ids:
            self._states.pop(request_id, None)
            self._tails.pop(request_id, None)

    @torch.inference_mode()
    def receive_features(self, features: Features) -> None:
        """Keep the target's features of the positions the head has not written yet, as hidden inputs (an
        EAGLE-3 head's fc applied to all of them in one product)."""
        new: list[tuple[_HeadState, torch.Tensor]] = []
        for request_id, (start, rows) in features.items():
            state = self._states.get(request_id)
            if state is None or start + len(rows) <= state.end:
                continue
            if start > state.end:
                raise RuntimeError(f"{request_id}: features from position {start} leave a gap after {state.end}")
            new.append((state, rows[state.end - start :]))
        if not new:
            return
        fused = self.head.fuse(torch.cat([rows for _, rows in new]).to(self.device))
        for (state, _), part in zip(new, fused.split([len(rows) for _, rows in new])):
            state.features = part if state.features is None else torch.cat((state.features, part))

    def draft(self, plan: DraftPlan) -> None:
        plan = replace(plan, tasks=[self._within_capacity(t) for t in plan.tasks])
        ready = [t for t in plan.tasks if t.num_tokens > 0 and self._can_draft(t)]
        draft = self._draft_windows if self.mask_token is None else self._draft_in_one_pass
        drafts = draft(ready) if ready else []
        if plan.tetris_capacity is not None and drafts:
            keep = tetris_select([d.token_probs for d in drafts], plan.tetris_capacity)
            for d, n in zip(drafts, keep):
                d.truncate(n)
        windows = dict(zip((t.request_id for t in ready), drafts))
        for task in plan.tasks:  # no window (nothing asked, or no features yet): the verifier decodes plainly
            self._windows[task.request_id] = (self._base(task), windows.get(task.request_id, Drafts()))

    def _can_draft(self, task: DraftTask) -> bool:
        """A continuation: the tail of the window it continues. Otherwise features up to the position before
        the newest token."""
        if task.continue_window and self._handed.get(task.request_id):
            return len(self._tails.get(task.request_id, [])) >= len(self._handed[task.request_id])
        tokens = self.sequences[task.request_id].tokens
        return self._states[task.request_id].end >= len(tokens) - 1 >= 1

    def _draft_windows(self, tasks: list[DraftTask]) -> list[Drafts]:
        seqs = [self.sequences[t.request_id] for t in tasks]
        bases = [self._base(t) for t in tasks]
        drafts = [Drafts() for _ in tasks]
        draws = self._window_draws(seqs, bases, max(t.num_tokens for t in tasks))
        inputs = [self._first_input(t, seq) for t, seq in zip(tasks, seqs)]
        tails: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in tasks]
        live = list(range(len(tasks)))
        for step in range(max(t.num_tokens for t in tasks)):
            logits = self.runner.forward([inputs[i] for i in live])
            hidden = self.runner.head_hidden
            rows = ((seqs[i], seqs[i].history(bases[i], drafts[i].tokens)) for i in live)
            logits = self._penalized(logits, seqs, rows)
            tokens, token_probs, q = draft_sample(logits, [seqs[i].params for i in live], draws[live, step],
                                                  self.support_size)  # fmt: skip
            for row, i in enumerate(live):
                drafts[i].tokens.append(tokens[row])
                drafts[i].token_probs.append(token_probs[row])
                drafts[i].q_ids.append(q.token_ids[row])
                drafts[i].q_probs.append(q.probs[row])
                position = inputs[i].start_pos + len(inputs[i].token_ids)  # the position after the last written
                inputs[i] = SeqInput(seqs[i].slot, [tokens[row]], position, hidden=hidden[row : row + 1])
                tails[i].append((position, tokens[row], hidden[row : row + 1]))
            live = [i for i in live if tasks[i].num_tokens > step + 1]
        for task, tail in zip(tasks, tails):
            self._tails[task.request_id] = tail
        return drafts

    @torch.inference_mode()
    def _draft_in_one_pass(self, tasks: list[DraftTask]) -> list[Drafts]:
        """P-EAGLE: each window's first input, then k - 1 masked positions, in one forward."""
        seqs = [self.sequences[t.request_id] for t in tasks]
        bases = [self._base(t) for t in tasks]
        widths = [t.num_tokens for t in tasks]
        assert self.mask_token is not None and self.head.mask_hidden is not None
        mask = self.head.fuse(self.head.mask_hidden[None, :])
        inputs = []
        for task, seq, n in zip(tasks, seqs, widths):
            first = self._first_input(task, seq)
            hidden = torch.cat((first.hidden.to(mask.dtype), mask.expand(n - 1, -1)))
            inputs.append(SeqInput(seq.slot, first.token_ids + [self.mask_token] * (n - 1), first.start_pos, n, hidden))
        logits = self.runner.forward(inputs)
        # Each position's q is drawn without the drafts before it, so it is processed with the window's base.
        rows = ((seq, seq.history(base)) for seq, base, n in zip(seqs, bases, widths) for _ in range(n))
        logits = self._penalized(logits, seqs, rows)
        draws = self._window_draws(seqs, bases, max(widths))
        params = [seq.params for seq, n in zip(seqs, widths) for _ in range(n)]
        tokens, token_probs, q = draft_sample(logits, params, torch.cat([draws[i, :n] for i, n in enumerate(widths)]),
                                              self.support_size)  # fmt: skip
        drafts, row, hidden = [], 0, self.runner.head_hidden
        for task, window, n in zip(tasks, inputs, widths):
            rows_of = slice(row, row + n)
            drafts.append(Drafts(tokens[rows_of], token_probs[rows_of], list(q.token_ids[rows_of]),
                                 list(q.probs[rows_of])))  # fmt: skip
            last = window.start_pos + len(window.token_ids) - n  # the position of the window's first row
            self._tails[task.request_id] = [(last + j + 1, tokens[row + j], hidden[row + j : row + j + 1])
                                            for j in range(n)]  # fmt: skip
            row += n
        return drafts

    def _first_input(self, task: DraftTask, seq: _Sequence) -> SeqInput:
        """A continuation goes on after the handed window's last token (Tetris may have cut the window)."""
        handed = self._handed.get(task.request_id) if task.continue_window else None
        if handed:
            position, token, hidden = self._tails[task.request_id][len(handed) - 1]
            return SeqInput(seq.slot, [token], position, hidden=hidden)
        return self._catch_up(seq, self._states[task.request_id])

    def _catch_up(self, seq: _Sequence, state: _HeadState) -> SeqInput:
        """The window's first input: head positions written .. n - 1 (token t_{p+1}, the target's features),
        n = the newest token's position. Afterwards only n - 1 stays to be written again."""
        n = len(seq.tokens) - 1
        first = min(state.written, n - 1)
        assert state.features is not None and state.start <= first
        rows = state.features[first - state.start : n - state.start]
        inputs = SeqInput(seq.slot, seq.tokens[first + 1 : n + 1], first, hidden=rows)
        state.written, state.start, state.features = n - 1, n - 1, state.features[n - 1 - state.start :]
        return inputs
