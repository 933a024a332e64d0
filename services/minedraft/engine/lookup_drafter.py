"""The drafter without a model (`method: ngram` or `suffix`): windows from text the request already has.

It keeps each request's committed tokens as every drafter does (engine/workers/), and beside them the index
its method looks up (engine/lookup.py); a request's prediction, where it sent one, proposes first. Nothing here
runs on an accelerator or holds a KV cache: prefill chunks and LoRA adapters are nothing to it. A task whose
lookup finds nothing gets an empty window, which the verifier decodes plainly (one token, a plain step's cost).
"""

from __future__ import annotations

import torch

from minedraft.config import LoraModule, SpeculativeConfig
from minedraft.engine.lookup import NgramIndex, SharedSuffixes, SuffixIndex, SuffixSettings
from minedraft.engine.plans import Admission, DraftPlan, Drafts, DraftTask, LoraChange
from minedraft.engine.workers import DraftWorker, point_mass
from minedraft.engine.workers.sequence import _Sequence


class LookupDraftWorker(DraftWorker):
    def __init__(self, spec: SpeculativeConfig, max_seq_len: int, support_size: int) -> None:
        super().__init__(None, support_size)  # type: ignore[arg-type] (no model: nothing reads the runner)
        self.method = spec.method
        self.max_seq_len = max_seq_len
        self._ngram_sizes = spec.ngram_sizes
        self._suffix = SuffixSettings(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_spec_factor,
                                      spec.suffix_decoding_min_token_prob)  # fmt: skip
        self.shared = SharedSuffixes(self._suffix, spec.suffix_decoding_max_cached_requests,
                                     spec.suffix_decoding_max_cached_tokens)  # fmt: skip
        self._indexes: dict[str, NgramIndex | SuffixIndex] = {}

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def kv_blocks(self) -> int | None:
        return None

    def take_work(self) -> tuple[int, int]:
        return 0, 0

    def take_prefix_stats(self) -> tuple[int, int]:
        return 0, 0

    def change_loras(self, changes: list[LoraChange]) -> dict[str, str]:
        """Nothing to load: a lookup drafts the same for every adapter (the target verifies with its own)."""
        return {change.name: "" for change in changes if isinstance(change, LoraModule)}

    def set_loras(self, modules: list[LoraModule]) -> dict[str, str]:
        return {}

    def admit(self, admissions: list[Admission]) -> None:
        for admission in admissions:
            self.release([admission.request_id])
            num_prompt = admission.num_prompt_tokens
            self.sequences[admission.request_id] = _Sequence(
                slot=-1, tokens=list(admission.token_ids), params=admission.params, seed=admission.seed,
                num_prompt=len(admission.token_ids) if num_prompt is None else num_prompt,
            )  # fmt: skip
            index = NgramIndex(*self._ngram_sizes) if self.method == "ngram" else SuffixIndex(self._suffix)
            self._extend(index, admission.token_ids)
            self._indexes[admission.request_id] = index
        self._track_predictions(admissions)

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            seq = self.sequences.pop(request_id, None)
            if seq is not None and self.method == "suffix":
                self.shared.add(seq.output)
            self._indexes.pop(request_id, None)
            self._windows.pop(request_id, None)
            self._handed.pop(request_id, None)
            self._predictions.pop(request_id, None)

    def reset(self) -> None:
        self.sequences.clear()
        self._indexes.clear()
        self._windows.clear()
        self._handed.clear()
        self._predictions.clear()

    def apply_results(self, verified) -> None:
        super().apply_results(verified)
        for result in verified:
            index = self._indexes.get(result.request_id)
            if index is not None:
                self._extend(index, result.token_ids)

    @staticmethod
    def _extend(index: NgramIndex | SuffixIndex, tokens: list[int]) -> None:
        if isinstance(index, NgramIndex):
            index.extend(tokens)
        else:
            index.extend(0, tokens)

    def _look_up(self, tasks: list[DraftTask]) -> dict[str, Drafts]:
        """The prediction's windows, then the method's for the other tasks."""
        windows = super()._look_up(tasks)
        for task in tasks:
            if task.request_id not in windows:
                tokens = self._propose(task)
                if tokens:
                    windows[task.request_id] = point_mass(tokens, self.support_size)
        return windows

    def _propose(self, task: DraftTask) -> list[int]:
        context, index = self._base(task), self._indexes[task.request_id]
        if isinstance(index, NgramIndex):
            return index.propose(context, task.num_tokens)
        own, own_score = index.propose(context, task.num_tokens)
        shared, shared_score = self.shared.index.propose(context, task.num_tokens)
        return shared if shared_score > own_score else own

    def _draft_with_model(self, plan: DraftPlan) -> None:
        """No model: every task the lookups found nothing for gets an empty window."""
        for task in plan.tasks:
            self._windows[task.request_id] = (self._base(task), Drafts())
