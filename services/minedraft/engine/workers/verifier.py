"""The verifier's worker: runs the target over each request's pending tokens and drafts, rejection-samples, and
commits what every rank accepts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minedraft.engine.plans import Drafts, Verified, VerifyPlan
from minedraft.engine.workers.base import _Worker, point_mass, sparse_q
from minedraft.engine.workers.sequence import _Sequence
from minedraft.model.runner import ModelRunner, SeqInput
from minedraft.sampling.logprobs import prompt_token_logprobs, token_logprobs
from minedraft.sampling.params import TokenLogprob
from minedraft.sampling.rejection import rejection_sample
from minedraft.sampling.streams import RowKeys


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
