"""The drafter's and the verifier's model-side work, independent of how they talk to each other.

Each worker keeps, per request, a mirror of the committed tokens and the list of tokens its KV cache
holds. Before every forward it compares the two: the common prefix stays, everything after it is
overwritten (a rollback is just a smaller start position), and the last committed token is always fed
again when needed so that its logits exist. This one rule covers prefill, verification, rollback after
rejection, and PEARL's continuation windows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from minedraft.config import LoraModule
from minedraft.engine.lookup import Prediction
from minedraft.engine.plans import (
    Admission,
    DraftPlan,
    Drafts,
    DraftTask,
    LoraChange,
    PrefillTask,
    Verified,
    VerifyPlan,
)
from minedraft.model.lora import LoraError
from minedraft.model.runner import ModelRunner, SeqInput
from minedraft.sampling.logprobs import prompt_token_logprobs, token_logprobs
from minedraft.sampling.params import SamplingParams, TokenLogprob
from minedraft.sampling.penalties import History, apply_penalties
from minedraft.sampling.rejection import rejection_sample
from minedraft.sampling.sampler import SparseProbs, draft_sample, greedy_layout
from minedraft.sampling.streams import DRAFT, RowKeys, seed_tensor, uniforms
from minedraft.sampling.tetris import tetris_select

if TYPE_CHECKING:  # xgrammar is optional: sampling.grammar is imported when a request asks for a grammar
    from minedraft.sampling.grammar import GrammarBook, GrammarState

_TAIL_SCAN = 64


@dataclass
class _Sequence:
    slot: int  # the sequence's id in the runner's KV cache
    tokens: list[int]  # committed tokens (prompt + verified output), mirrored from the engine
    params: SamplingParams
    seed: int  # with the output position, keys every random draw (sampling/streams.py)
    kv_tokens: list[int] = field(default_factory=list)  # what the KV cache holds, position by position
    num_prompt: int = 0  # tokens[:num_prompt] are the prompt: penalties count what follows
    bad_words_ids: list[list[int]] = field(default_factory=list)
    grammar: GrammarState | None = None  # structured output: the matcher over the committed output
    # prompt_logprobs: those of prompt tokens 1.. computed so far (rank 0's); None once sent or never asked
    prompt_lps: list[TokenLogprob] | None = None
    prompt_rows_done: int = 0  # prompt tokens 1.. whose rows a forward has produced (every rank counts them)
    cached_features: int = 0  # a verifier keeping features: positions reused from its cache, not yet handed on

    def owed_prompt_rows(self, start: int, num_rows: int) -> int:
        """How many of `num_rows` rows at positions start.. predict a prompt token whose logprob is still owed
        (position q predicts token q + 1); counts them as produced."""
        if self.params.prompt_logprobs is None or start != self.prompt_rows_done:
            return 0
        owed = max(0, min(start + num_rows, self.num_prompt - 1) - start)
        self.prompt_rows_done += owed
        return owed

    @property
    def output(self) -> list[int]:
        """The committed tokens after the prompt (on a resumed request, those of its earlier run included)."""
        return self.tokens[self.num_prompt :]

    def history(self, base: list[int] | None = None, extra: list[int] = ()) -> History:
        """The tokens before a row that follows `base` (default: the committed tokens) and then `extra`."""
        return History(self.tokens if base is None else base, self.num_prompt, extra, self.bad_words_ids)

    def pending(self, target: list[int]) -> tuple[int, list[int]]:
        """Where to start writing, and the tokens to write, so the cache ends up holding `target`.

        At least the last token is always rewritten: its logits are what the next step samples from.
        """
        limit = min(len(self.kv_tokens), len(target) - 1)
        # Differences sit near the end (rejected drafts), so compare the long head in one C-level
        # list comparison and scan only the tail.
        keep = max(0, limit - _TAIL_SCAN)
        if self.kv_tokens[:keep] != target[:keep]:
            keep = 0
        while keep < limit and self.kv_tokens[keep] == target[keep]:
            keep += 1
        return keep, target[keep:]


def point_mass(tokens: list[int], support_size: int) -> Drafts:
    """A window proposed without a model: q puts all its mass on each token (engine/lookup.py)."""
    layout = greedy_layout(torch.tensor(tokens), support_size)
    return Drafts(list(tokens), [1.0] * len(tokens), list(layout.token_ids), list(layout.probs))


def sparse_q(drafts: Drafts) -> SparseProbs | None:
    """The draft distributions of a window as one sparse q (None for an empty window)."""
    if not drafts.tokens:
        return None
    return SparseProbs(token_ids=torch.stack(drafts.q_ids), probs=torch.stack(drafts.q_probs))


class _Worker:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.sequences: dict[str, _Sequence] = {}
        self._grammars: GrammarBook | None = None
        self._predictions: dict[str, Prediction] = {}  # request -> its prediction (Predicted Outputs), if it sent one

    def _track_predictions(self, admissions: list[Admission]) -> None:
        """Follow each admitted request's prediction from the output it has so far (a re-admission's included)."""
        for admission in admissions:
            self._predictions.pop(admission.request_id, None)
            if admission.prediction_ids:
                prediction = Prediction(admission.prediction_ids)
                prediction.extend(self.sequences[admission.request_id].output)
                self._predictions[admission.request_id] = prediction

    def _follow_prediction(self, request_id: str, new_tokens: list[int]) -> None:
        prediction = self._predictions.get(request_id)
        if prediction is not None:
            prediction.extend(new_tokens)

    @property
    def device(self) -> torch.device:
        return torch.device(self.runner.device)

    @property
    def kv_blocks(self) -> int | None:
        """The blocks of this worker's KV pool (None: it keeps no KV cache)."""
        return self.runner.kv_cache.num_blocks

    def take_work(self) -> tuple[int, int]:
        """(forwards, tokens) of the model since the last call (the adaptive controller's cost model)."""
        return self.runner.take_work()

    def take_prefix_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, those found) since the last call."""
        return self.runner.kv_cache.take_prefix_stats()

    def _adapter(self, name: str | None) -> str | None:
        """The LoRA adapter this worker's model applies for a request of adapter `name`: the target its own."""
        return name

    def _adapter_folder(self, module: LoraModule) -> str | None:
        """The folder of `module` this worker's model loads: the target its own."""
        return module.path

    def change_loras(self, changes: list[LoraChange]) -> dict[str, str]:
        """Load and unload LoRA adapters while serving, in order (no running request uses one unloaded). Returns,
        for each load, "" or why this worker could not (its adapters are then as before that load)."""
        lora, loaded = self.runner.lora, {}
        for change in changes:
            name = change if isinstance(change, str) else change.name
            folder = None if isinstance(change, str) else self._adapter_folder(change)
            if lora is not None:
                lora.remove(name)  # an unload, or a load that takes a folder's place (or has none for this model)
            if isinstance(change, str) or folder is None:
                loaded.update({} if isinstance(change, str) else {name: ""})
                continue
            try:
                if lora is None:
                    raise LoraError(f"{self.runner.path} was started without LoRA (enable_lora)")
                lora.add(name, folder)
                loaded[name] = ""
            except LoraError as exc:
                loaded[name] = str(exc)
        return loaded

    def set_loras(self, modules: list[LoraModule]) -> dict[str, str]:
        """Serve exactly these adapters (a new world's set: a restarted worker catches up with the group's
        run-time loads and unloads). Returns, for each that could not be loaded, why."""
        lora = self.runner.lora
        if lora is None:
            return {}
        wanted = {m.name: m for m in modules}
        changes: list[LoraChange] = [n for n in list(lora.options.adapters) if n not in wanted]
        changes += [m for m in modules if lora.options.adapters.get(m.name, None) != self._adapter_folder(m)]
        return {name: error for name, error in self.change_loras(changes).items() if error}

    def admit(self, admissions: list[Admission]) -> None:
        """Hold new requests; each starts from the longest cached prefix of its tokens (its own earlier blocks
        after a preemption, a shared system prompt, the running requests' committed blocks)."""
        if admissions:
            for seq in self.sequences.values():
                self._cache_committed(seq)
        for admission in admissions:
            if admission.request_id in self.sequences:
                self.release([admission.request_id])  # re-admission rebuilds the request from scratch
            seq = _Sequence(
                slot=self.runner.allocate_slot(self._adapter(admission.lora)),
                tokens=list(admission.token_ids),
                params=admission.params,
                seed=admission.seed,
                num_prompt=len(admission.token_ids) if admission.num_prompt_tokens is None
                else admission.num_prompt_tokens,
                bad_words_ids=admission.bad_words_ids,
            )
            # A request asking for prompt logprobs needs logits at every prompt position: it reuses no cached block.
            if admission.params.prompt_logprobs is None:
                seq.kv_tokens = seq.tokens[: self.runner.kv_cache.reuse_prefix(seq.slot, seq.tokens)]
                seq.cached_features = len(seq.kv_tokens) if self.runner.kv_cache.features is not None else 0
            else:
                seq.prompt_lps = []
            if admission.params.structured_outputs is not None:
                seq.grammar = self._grammar_book().state(admission.params.structured_outputs, seq.num_prompt)
            self.sequences[admission.request_id] = seq
        self._track_predictions(admissions)

    def _grammar_book(self) -> GrammarBook:
        if self._grammars is None:
            from minedraft.sampling.grammar import GrammarBook

            config = self.runner.config
            self._grammars = GrammarBook(self.runner.tokenizer, config.vocab_size, config.eos_token_ids)
        return self._grammars

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            seq = self.sequences.pop(request_id, None)
            self._predictions.pop(request_id, None)
            if seq is not None:
                self._cache_committed(seq)
                self.runner.free_slot(seq.slot)

    def reset(self) -> None:
        """Drop every request and the prefix cache (a new world or a new scheduler): all KV blocks are free."""
        self.release(list(self.sequences))
        self.runner.kv_cache.clear_prefix_cache()

    def _cache_committed(self, seq: _Sequence) -> None:
        """Offer the prefix cache the blocks that hold committed tokens, up to the last one (which a next
        forward may write again): drafts past it may still be rejected and overwritten."""
        cache = self.runner.kv_cache
        if cache.prefix_index is None:
            return
        end, size = min(len(seq.kv_tokens), len(seq.tokens) - 1), cache.block_size
        valid = cache.cached_tokens(seq.slot)
        while valid + size <= end and seq.kv_tokens[valid : valid + size] == seq.tokens[valid : valid + size]:
            valid += size
        cache.cache_prefix(seq.slot, seq.tokens, valid)

    @property
    def num_active(self) -> int:
        return len(self.sequences)

    def _penalized(
        self, logits: torch.Tensor, seqs: list[_Sequence], rows: Iterable[tuple[_Sequence, History]]
    ) -> torch.Tensor:
        """Each row's logits after its request's min_tokens, logit_bias and penalties (sampling/penalties.py)
        and its grammar (sampling/grammar.py). `seqs`: the batch's requests; `rows`: each logits row's request
        and history, read only when one of them asks for processing."""
        penalize = any(seq.params.penalized for seq in seqs)
        constrain = any(seq.grammar is not None for seq in seqs)
        if not (penalize or constrain):
            return logits
        row_seqs, histories = zip(*rows)
        if penalize:
            eos = self.runner.config.eos_token_ids
            logits = apply_penalties(logits, [seq.params for seq in row_seqs], histories, eos)
        if constrain:
            logits = self._grammar_masked(logits, row_seqs, histories)
        return logits

    def _grammar_masked(
        self, logits: torch.Tensor, row_seqs: tuple[_Sequence, ...], histories: tuple[History, ...]
    ) -> torch.Tensor:
        from minedraft.sampling.grammar import masked

        for seq in {id(seq): seq for seq in row_seqs if seq.grammar is not None}.values():
            seq.grammar.sync(seq.tokens)
        # A row's tokens after the committed output: a drafter's base may hold handed drafts, then its extra.
        rows = [(seq.grammar, [*h.tokens[len(seq.tokens) :], *h.extra]) if seq.grammar is not None else (None, ())
                for seq, h in zip(row_seqs, histories)]  # fmt: skip
        return masked(logits, rows, self._grammar_book().vocab_size)

    def _prefill_inputs(self, tasks: list[PrefillTask]) -> list[SeqInput]:
        """The next chunk of each prefilling request: from what the cache holds up to the task's end."""
        return [chunk for _, _, chunk, _ in self._prefill_chunks(tasks, prompt_logits=False)]

    def _prefill_chunks(self, tasks: list[PrefillTask],
                        prompt_logits: bool) -> list[tuple[str, _Sequence, SeqInput, int]]:  # fmt: skip
        """Each chunk's request id, request, input and owed prompt rows. With `prompt_logits` (the verifier), a
        chunk of a request owed prompt logprobs gets a logits row per token (its first rows are the owed ones)."""
        chunks = []
        for task in tasks:
            seq = self.sequences[task.request_id]
            start = len(seq.kv_tokens)
            if task.num_tokens > start:
                tokens = seq.tokens[start : task.num_tokens]
                owed = seq.owed_prompt_rows(start, len(tokens)) if prompt_logits else 0
                chunk = SeqInput(seq.slot, tokens, start, num_logits=len(tokens) if owed else 0)
                chunks.append((task.request_id, seq, chunk, owed))
        return chunks

    def _prefilled(self, tasks: list[PrefillTask]) -> None:
        for task in tasks:
            seq = self.sequences[task.request_id]
            seq.kv_tokens = seq.tokens[: max(task.num_tokens, len(seq.kv_tokens))]


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


class VerifyWorker(_Worker):
    """Runs the target over each request's pending tokens and drafts, then rejection-samples."""

    def __init__(self, runner: ModelRunner, prediction_window: int = 0) -> None:
        super().__init__(runner)
        self._drafts: dict[str, Drafts] = {}
        self._features: dict[str, tuple[int, torch.Tensor]] = {}
        # With no drafter in the world: the most tokens of a request's prediction it verifies in a step, drafted
        # here (0: none; a drafter drafts from predictions where there is one).
        self.prediction_window = prediction_window

    def release(self, request_ids: list[str]) -> None:
        super().release(request_ids)
        for request_id in request_ids:
            self._drafts.pop(request_id, None)

    def receive_drafts(self, drafts: dict[str, Drafts]) -> None:
        self._drafts.update(drafts)

    def held_tokens(self, plan: VerifyPlan) -> int:
        """The decoding tokens the plan feeds the target: each request's last token and the window this worker
        holds for it (none: a plain step, one token per request)."""
        return sum(1 + len(self._drafts[t.request_id].tokens if t.request_id in self._drafts else ())
                   for t in plan.tasks)  # fmt: skip

    def prompt_tokens(self, plan: VerifyPlan) -> int:
        """The tokens the plan feeds the target beyond decoding's: what starting requests' caches lack of their
        prompts (a wave of new requests is read in one verification) and the prefill chunks'. Asked once the
        plan's admissions are applied."""

        def held(request_id: str) -> tuple[int, int]:
            """The request's committed tokens and those its cache holds."""
            seq = self.sequences.get(request_id)
            return (len(seq.tokens), len(seq.kv_tokens)) if seq is not None else (0, 0)

        starts = (held(t.request_id) for t in plan.tasks)
        reading = sum(max(0, committed - written - 1) for committed, written in starts)
        return reading + sum(max(0, t.num_tokens - held(t.request_id)[1]) for t in plan.prefill)

    def verify(self, plan: VerifyPlan) -> list[Verified]:
        """Forward, sample and commit (a single process, or tensor-parallel rank 0)."""
        batch = self.forward(plan)
        results = self.sample(batch)
        self._features = self.features(batch, results)
        self.commit(batch, results)
        return results

    def take_features(self) -> dict[str, tuple[int, torch.Tensor]]:
        """The last `verify`'s features (see `features`), once."""
        features, self._features = self._features, {}
        return features

    def features(self, batch: VerifyBatch, results: list[Verified]) -> dict[str, tuple[int, torch.Tensor]]:
        """For an EAGLE drafter (a runner with aux_hidden_layers): per request, the first position and the
        target's features [rows, feature_width] of the positions whose tokens are now committed: a window's
        pending tokens and accepted drafts, a prefill chunk's tokens, and first of all those of the prefix a
        request took from the cache. Empty without aux_hidden_layers."""
        aux = batch.aux_hidden
        if aux is None:
            return {}
        accepted = {r.request_id: r.num_accepted for r in results}
        features, offset = {}, 0
        for request_id, start, rows, drafts in batch.inputs:
            keep = rows - drafts + accepted.get(request_id, 0) if drafts >= 0 else rows
            if keep > 0:
                features[request_id] = self._after_cached(request_id, start, aux[offset : offset + keep])
            offset += rows
        return features

    def _after_cached(self, request_id: str, start: int, rows: torch.Tensor) -> tuple[int, torch.Tensor]:
        """`rows` from `start`, after the features of the cached prefix the request has not handed on yet."""
        seq = self.sequences[request_id]
        if not seq.cached_features:
            return start, rows
        cached = self.runner.kv_cache.read_features(seq.slot, seq.cached_features)
        seq.cached_features = 0
        return 0, torch.cat((cached, rows))

    def forward(self, plan: VerifyPlan) -> VerifyBatch:
        """Run the target over every task's pending tokens + drafts (collective under tensor parallelism)."""
        seqs = [self.sequences[t.request_id] for t in plan.tasks]
        windows = [self._drafts.pop(t.request_id, None) or self._predicted(t.request_id) for t in plan.tasks]
        for seq, window in zip(seqs, windows):  # a plan made ahead may run a request once past its end
            window.truncate(max(0, self.runner.max_seq_len - len(seq.tokens)))
        inputs = [seq.pending(seq.tokens) for seq in seqs]
        # Prompt tokens owed prompt logprobs; their rows are the first of the written ones (the last is sampled).
        owed = [seq.owed_prompt_rows(start, len(written) - 1) for seq, (start, written) in zip(seqs, inputs)]
        ahead = [len(written) - 1 if n else 0 for (_, written), n in zip(inputs, owed)]
        verify_inputs = [
            SeqInput(seq.slot, written + w.tokens, start, num_logits=n + len(w.tokens) + 1)
            for seq, (start, written), w, n in zip(seqs, inputs, windows, ahead)
        ]
        chunks = self._prefill_chunks(plan.prefill, prompt_logits=True)  # rows only for prompt logprobs
        logits = self.runner.forward(verify_inputs + [chunk for _, _, chunk, _ in chunks])
        prompt_rows = [(seq, start, n, a) for seq, (start, _), n, a in zip(seqs, inputs, owed, ahead)]
        prompt_rows += [(seq, chunk.start_pos, n, chunk.num_logits) for _, seq, chunk, n in chunks]
        self._prefilled(plan.prefill)
        rows = [(t.request_id, i.start_pos, len(i.token_ids), len(w.tokens))
                for t, i, w in zip(plan.tasks, verify_inputs, windows)]  # fmt: skip
        rows += [(request_id, chunk.start_pos, len(chunk.token_ids), -1) for request_id, _, chunk, _ in chunks]
        return VerifyBatch(plan, seqs, windows, logits, prompt_rows, rows, self.runner.aux_hidden)

    def _predicted(self, request_id: str) -> Drafts:
        """The window a request's prediction proposes, where this worker drafts from predictions itself (every
        tensor-parallel rank alike: they follow the same tokens)."""
        prediction = self._predictions.get(request_id)
        if not self.prediction_window or prediction is None:
            return Drafts()
        own = self.sequences[request_id].params.num_speculative_tokens
        tokens = prediction.propose(self.prediction_window if own is None else min(own, self.prediction_window))
        return point_mass(tokens, 1) if tokens else Drafts()

    def sample(self, batch: VerifyBatch) -> list[Verified]:
        """Rejection-sample every task's window; drop the bonus where PEARL continues the request."""
        logits = self._take_prompt_logprobs(batch)
        if not batch.seqs:  # a step of prefill chunks only
            return []
        rows = ((seq, seq.history(extra=w.tokens[:i])) for seq, w in zip(batch.seqs, batch.windows)
                for i in range(len(w.tokens) + 1))  # fmt: skip
        logits = self._penalized(logits, batch.seqs, rows)
        # Greedy windows are verified against the argmax alone: their q is never read (stacking it was a tenth
        # of a one-request verification).
        greedy = all(seq.params.greedy for seq in batch.seqs)
        new_tokens = rejection_sample(
            logits,
            [w.tokens for w in batch.windows],
            [None if greedy else sparse_q(w) for w in batch.windows],
            [seq.params for seq in batch.seqs],
            RowKeys.of([seq.seed for seq in batch.seqs], [len(seq.tokens) for seq in batch.seqs]),
        )
        logprobs = self._logprobs(logits, batch, new_tokens)
        results = []
        for task, seq, w, tokens, lps in zip(batch.plan.tasks, batch.seqs, batch.windows, new_tokens, logprobs):
            accepted = len(tokens) - 1
            if w.tokens and accepted == len(w.tokens) and not task.keep_bonus:
                tokens = tokens[:-1]
            lps = None if lps is None else lps[: len(tokens)]
            prompt_lps = self._owed_prompt_logprobs(seq)
            results.append(Verified(task.request_id, tokens, len(w.tokens), accepted, lps, prompt_lps))
        return results

    @staticmethod
    def _owed_prompt_logprobs(seq: _Sequence) -> list[TokenLogprob] | None:
        """The request's prompt logprobs, once all are computed (they go with its first verification)."""
        if seq.prompt_lps is None or len(seq.prompt_lps) < seq.num_prompt - 1:
            return None
        lps, seq.prompt_lps = seq.prompt_lps, None
        return lps

    @staticmethod
    def _take_prompt_logprobs(batch: VerifyBatch) -> torch.Tensor:
        """Compute the prompt logprobs of the batch's prompt rows (raw logits) into each request's list; return
        the logits without those rows, as `sample` expects them: each window's len(drafts) + 1 rows, in order."""
        if not any(n for _, _, n, _ in batch.prompt_rows):
            return batch.logits
        keep, offset = [], 0
        windows = [len(w.tokens) + 1 for w in batch.windows] + [0] * (len(batch.prompt_rows) - len(batch.seqs))
        for (seq, start, owed, ahead), own in zip(batch.prompt_rows, windows):
            if owed and seq.prompt_lps is not None:
                tokens = seq.tokens[start + 1 : start + 1 + owed]
                seq.prompt_lps.extend(prompt_token_logprobs(batch.logits[offset : offset + owed], tokens,
                                                            seq.params.prompt_logprobs))  # fmt: skip
            keep.extend(range(offset + ahead, offset + ahead + own))
            offset += ahead + own
        return batch.logits[torch.tensor(keep, dtype=torch.long, device=batch.logits.device)]

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, batch: VerifyBatch, new_tokens: list[list[int]]
    ) -> list[list[TokenLogprob] | None]:
        """Per request that asks for them, the logprobs of its new tokens: new token j came from its row j."""
        rows, params, tokens, start = [], [], [], 0
        for seq, w, out in zip(batch.seqs, batch.windows, new_tokens):
            if seq.params.logprobs is not None:
                rows.extend(range(start, start + len(out)))
                params.extend([seq.params] * len(out))
                tokens.extend(out)
            start += len(w.tokens) + 1
        if not rows:
            return [None] * len(new_tokens)
        flat = iter(token_logprobs(logits[torch.tensor(rows, device=logits.device)], params, tokens))
        return [[next(flat) for _ in out] if seq.params.logprobs is not None else None
                for seq, out in zip(batch.seqs, new_tokens)]  # fmt: skip

    def commit(self, batch: VerifyBatch, results: list[Verified]) -> None:
        """Record what the cache now holds and the new committed tokens (followers get `results` from rank 0)."""
        for seq, w, result in zip(batch.seqs, batch.windows, results):
            seq.kv_tokens = seq.tokens + w.tokens
            seq.tokens.extend(result.token_ids)
            self._follow_prediction(result.request_id, result.token_ids)
        # Indexed now, not only at the next admission: admission counts the blocks requests share from the
        # step after they were written (engine/batch_manager.py).
        for request_id, *_ in batch.inputs:
            seq = self.sequences.get(request_id)
            if seq is not None:
                self._cache_committed(seq)


@dataclass
class VerifyBatch:
    """A verification between its forward and its commit."""

    plan: VerifyPlan
    seqs: list[_Sequence]
    windows: list[Drafts]
    logits: torch.Tensor
    # Per input of the forward (windows, then prefill chunks): its request, start position, how many of its first
    # rows are owed prompt rows, and its rows ahead of its window's (a chunk has no window rows).
    prompt_rows: list[tuple[_Sequence, int, int, int]] = field(default_factory=list)
    # Per input of the forward: its request, start position, tokens, and draft tokens among them (-1: a chunk).
    inputs: list[tuple[str, int, int, int]] = field(default_factory=list)
    aux_hidden: torch.Tensor | None = None  # [tokens, feature_width]: the target's features for an EAGLE drafter
