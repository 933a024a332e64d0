"""What the drafter's and the verifier's workers share: the requests they hold, their LoRA adapters, admission
and release with the prefix cache, the logits processing of penalties and grammars, and prefill chunks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from minedraft.config import LoraModule
from minedraft.engine.lookup import Prediction
from minedraft.engine.plans import Admission, Drafts, LoraChange, PrefillTask
from minedraft.engine.workers.sequence import _Sequence
from minedraft.model.lora import LoraError
from minedraft.model.runner import ModelRunner, SeqInput
from minedraft.sampling.penalties import History, apply_penalties
from minedraft.sampling.sampler import SparseProbs, greedy_layout

if TYPE_CHECKING:  # xgrammar is optional: sampling.grammar is imported when a request asks for a grammar
    from minedraft.sampling.grammar import GrammarBook


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
