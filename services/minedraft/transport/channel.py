"""The step-end transfers between verifier ranks and the drafter, as fixed-dtype tensors.

Every transfer is a sizes message (int64) followed by at most two payload messages, never one message
per request and never a pickle. Request ids do not travel: both sides take the order from the step
plan. The sizes message carries a hash of that order, so two sides that disagree about it fail with a
clear error instead of silently mixing requests up. When the sizes say a payload would be empty, both
sides skip it, so the collective calls stay in lockstep. Bad arguments are rejected before anything
is sent; the peers then wait in vain until the group's timeout, like for any other failed rank.

Layouts (n = number of request ids of the transfer, S = support size):

- plan:    sizes [num_bytes];                        payload uint8 [num_bytes]
- results: sizes [n, ids_hash, total, (len, num_draft_tokens, num_accepted) * n]
           payload int64 [total]: every request's new tokens, concatenated in order
- drafts:  sizes [n, ids_hash, total, S, count * n], count = -1 for a dropped window
           payload int64 [total * (1 + S)]: all draft tokens, then all q id rows
           probs float32 [total * S]: all q probability rows
- features (verifier rank 0 -> an EAGLE drafter, after the results):
           sizes [n, ids_hash, total_rows, width, dtype code, (first position, rows) * n]
           payload [total_rows, width] in the target's dtype: the target's states of the committed positions

Under NCCL every tensor lives on the rank's GPU (`WorldGroups.device`). On the receiving side tokens and
counts come back as Python lists; q rows come back as row views of one received buffer on
`WorldGroups.device` (CPU under gloo, the GPU under NCCL, where the verifier needs them anyway).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from minedraft.engine.plans import Drafts, Verified
from minedraft.transport.groups import WorldGroups

_LEADER = 0  # verifier rank 0: samples, sends results, forwards plans
_RESULTS_HEADER = 3
_DRAFTS_HEADER = 4
_FEATURES_HEADER = 5
_DROPPED = -1
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the features' dtype codes


def ids_hash(request_ids: list[str]) -> int:
    """A signed 64-bit digest of the request order (length-prefixed, so ids may contain anything)."""
    digest = hashlib.blake2b(digest_size=8)
    for request_id in request_ids:
        raw = request_id.encode()
        digest.update(len(raw).to_bytes(4, "little"))
        digest.update(raw)
    return int.from_bytes(digest.digest(), "little", signed=True)


class StepChannel:
    """One rank's end of the step-end transfers. Every rank of the world makes the matching calls."""

    def __init__(self, groups: WorldGroups, support_size: int) -> None:
        if support_size < 1:
            raise ValueError(f"support_size must be >= 1, got {support_size}")
        self.groups = groups
        self.support_size = support_size
        self._has_followers = groups.topology.tp_size > 1

    # -- plan forwarding inside the verifier ------------------------------------------------------

    def broadcast_plan(self, plan: bytes | None) -> bytes:
        """Verifier rank 0 passes the plan's bytes; the other verifier ranks pass None and get them."""
        if self._verifier_role("broadcast_plan"):
            if plan is None:
                raise ValueError("verifier rank 0 must pass the plan bytes")
            self._send_plan(plan)
            return bytes(plan)
        if plan is not None:
            raise ValueError("only verifier rank 0 passes a plan; the other ranks pass None")
        return self._recv_plan()

    def _send_plan(self, plan: bytes) -> None:
        if not self._has_followers:
            return
        self._tp_broadcast(self._ints([len(plan)]))
        if plan:
            self._tp_broadcast(torch.frombuffer(bytearray(plan), dtype=torch.uint8).to(self.groups.device))

    def _recv_plan(self) -> bytes:
        size = self._ints([0])
        self._tp_broadcast(size)
        num_bytes = int(size.item())
        if num_bytes == 0:
            return b""
        payload = torch.empty(num_bytes, dtype=torch.uint8, device=self.groups.device)
        self._tp_broadcast(payload)
        return payload.cpu().numpy().tobytes()

    # -- results: verifier rank 0 -> drafter and TP followers -------------------------------------

    def send_results(self, results: list[Verified], to_drafter: bool = True) -> None:
        """Verifier rank 0: hand this step's results to the other verifier ranks, and to the drafter unless
        `to_drafter` is False (a step it sat out: it gets them later, `send_missed_results`)."""
        if not self._verifier_role("send_results"):
            raise RuntimeError("only verifier rank 0 sends results; the other ranks call recv_results")
        messages = self._result_messages(results)
        # The drafter's copy goes asynchronously so that it overlaps with the TP broadcast. The other verifier
        # ranks get theirs even when the drafter is gone: they must stay in step with rank 0 (the next thing
        # they receive from it may be a new world to join), so a failed send is raised only after that.
        pending, failure = [], None
        if to_drafter and self.groups.topology.has_drafter:
            try:
                pending = [dist.isend(m, dst=self.groups.topology.drafter_rank) for m in messages]
            except RuntimeError as exc:
                failure = exc
        if self._has_followers:
            for message in messages:
                self._tp_broadcast(message)
        for work in pending:
            work.wait()
        if failure is not None:
            raise failure

    def send_missed_results(self, results: list[Verified]) -> None:
        """Verifier rank 0: the results of the steps the drafter sat out, in one message (it calls
        recv_results with their request ids, in the same order)."""
        if not self._verifier_role("send_missed_results") or not self.groups.topology.has_drafter:
            raise RuntimeError("only verifier rank 0 of a world with a drafter sends it missed results")
        for message in self._result_messages(results):
            dist.send(message, dst=self.groups.topology.drafter_rank)

    def _result_messages(self, results: list[Verified]) -> list[torch.Tensor]:
        header = [len(results), ids_hash([r.request_id for r in results]), 0]
        counts: list[int] = []
        tokens: list[int] = []
        for result in results:
            counts += [len(result.token_ids), result.num_draft_tokens, result.num_accepted]
            tokens += result.token_ids
        header[2] = len(tokens)
        return [self._ints(header + counts)] + ([self._ints(tokens)] if tokens else [])

    def recv_results(self, request_ids: list[str]) -> list[Verified]:
        """Drafter and verifier ranks 1..tp-1: this step's results, in the order of `request_ids`."""
        if self.groups.is_verifier and self._verifier_role("recv_results"):
            raise RuntimeError("verifier rank 0 produces the results; it calls send_results")
        n = len(request_ids)
        sizes = self._recv_from_leader(torch.empty(_RESULTS_HEADER + 3 * n, dtype=torch.int64))
        total = self._check_header(sizes, request_ids, "results")
        tokens = self._recv_from_leader(torch.empty(total, dtype=torch.int64)) if total else []
        counts = sizes[_RESULTS_HEADER:]
        verified, offset = [], 0
        for i, request_id in enumerate(request_ids):
            length, num_draft, num_accepted = counts[3 * i : 3 * i + 3]
            verified.append(Verified(request_id, tokens[offset : offset + length], num_draft, num_accepted))
            offset += length
        return verified

    # -- features: verifier rank 0 -> an EAGLE drafter --------------------------------------------

    def send_features(self, request_ids: list[str], features: dict[str, tuple[int, torch.Tensor]],
                      width: int) -> None:  # fmt: skip
        """Verifier rank 0: the target's states of this step's committed positions, per request of
        `request_ids` (absent: none), rows of `width` values, to the drafter only."""
        if not self._verifier_role("send_features"):
            raise RuntimeError("only verifier rank 0 sends features")
        unknown = features.keys() - set(request_ids)
        if unknown:
            raise ValueError(f"features for requests not in this transfer: {sorted(unknown)}")
        spans = [features.get(r, (0, None)) for r in request_ids]
        rows = [t for _, t in spans if t is not None and len(t)]
        dtype = rows[0].dtype if rows else torch.float32
        if any(t.dtype != dtype or t.dim() != 2 or t.shape[1] != width for t in rows) or dtype not in _DTYPES:
            raise ValueError(f"feature rows must be 2-D, {width} wide, of one dtype of {_DTYPES}")
        counts = [x for start, t in spans for x in (start, 0 if t is None else len(t))]
        header = [len(request_ids), ids_hash(request_ids), sum(len(t) for t in rows), width, _DTYPES.index(dtype)]
        drafter = self.groups.topology.drafter_rank
        dist.send(self._ints(header + counts), dst=drafter)
        if rows:
            dist.send(torch.cat(rows).to(self.groups.device).contiguous(), dst=drafter)

    def recv_features(self, request_ids: list[str]) -> dict[str, tuple[int, torch.Tensor]]:
        """The drafter: per request (absent when none came), the first position and its rows (row views of
        one buffer on the communication device)."""
        if not self.groups.is_drafter:
            raise RuntimeError("only the drafter receives features")
        sizes = torch.empty(_FEATURES_HEADER + 2 * len(request_ids), dtype=torch.int64, device=self.groups.device)
        dist.recv(sizes, src=_LEADER)
        header = sizes.tolist()
        total = self._check_header(header, request_ids, "features")
        width, code = header[3], header[4]
        spans = header[_FEATURES_HEADER:]
        if width < 1 or not 0 <= code < len(_DTYPES) or sum(spans[1::2]) != total or min(spans, default=0) < 0:
            raise ValueError(f"features: corrupt sizes message {header[:_FEATURES_HEADER]}")
        if not total:
            return {}
        payload = torch.empty(total, width, dtype=_DTYPES[code], device=self.groups.device)
        dist.recv(payload, src=_LEADER)
        features, offset = {}, 0
        for request_id, start, rows in zip(request_ids, spans[0::2], spans[1::2]):
            if rows:
                features[request_id] = (start, payload[offset : offset + rows])
            offset += rows
        return features

    # -- drafts: drafter -> every verifier rank ---------------------------------------------------

    def send_drafts(self, request_ids: list[str], windows: dict[str, Drafts]) -> None:
        """Drafter: broadcast the new windows; a request absent from `windows` had its window dropped."""
        if not self.groups.is_drafter:
            raise RuntimeError("only the drafter sends drafts; verifier ranks call recv_drafts")
        unknown = windows.keys() - set(request_ids)
        if unknown:
            raise ValueError(f"windows for requests not in this transfer: {sorted(unknown)}")
        present = [windows[r] for r in request_ids if r in windows]
        for request_id in request_ids:
            window = windows.get(request_id)
            if window is not None and not len(window.tokens) == len(window.q_ids) == len(window.q_probs):
                raise ValueError(f"window of {request_id!r}: every draft token needs one q_ids and one q_probs row")
        counts = [len(windows[r].tokens) if r in windows else _DROPPED for r in request_ids]
        tokens = [t for window in present for t in window.tokens]
        header = [len(request_ids), ids_hash(request_ids), len(tokens), self.support_size]
        messages = [self._ints(header + counts)]
        if tokens:
            q_ids, q_probs = self._stack_q(present, len(tokens))
            messages.append(torch.cat([self._ints(tokens), q_ids.reshape(-1)]))
            messages.append(q_probs.reshape(-1))
        for message in messages:
            dist.broadcast(message, src=self.groups.topology.drafter_rank)

    def recv_drafts(self, request_ids: list[str]) -> dict[str, Drafts]:
        """Every verifier rank: the new windows by request; dropped windows are absent, empty ones empty."""
        self._verifier_role("recv_drafts")
        n, support, device = len(request_ids), self.support_size, self.groups.device
        drafter = self.groups.topology.drafter_rank
        sizes = torch.empty(_DRAFTS_HEADER + n, dtype=torch.int64, device=device)
        dist.broadcast(sizes, src=drafter)
        header = sizes.tolist()
        total = self._check_header(header, request_ids, "drafts")
        if header[3] != support:
            raise ValueError(f"drafts: the drafter sends q rows of {header[3]} entries, this rank expects {support}")
        counts = header[_DRAFTS_HEADER:]
        if sum(c for c in counts if c != _DROPPED) != total:
            raise ValueError(f"drafts: corrupt sizes message {header}")
        tokens: list[int] = []
        id_rows: list[torch.Tensor] = []
        prob_rows: list[torch.Tensor] = []
        if total:
            payload = torch.empty(total * (1 + support), dtype=torch.int64, device=device)
            probs = torch.empty(total * support, dtype=torch.float32, device=device)
            dist.broadcast(payload, src=drafter)
            dist.broadcast(probs, src=drafter)
            tokens = payload[:total].tolist()
            id_rows = list(payload[total:].view(total, support).unbind(0))
            prob_rows = list(probs.view(total, support).unbind(0))
        return _split_windows(request_ids, counts, tokens, id_rows, prob_rows)

    # -- helpers ----------------------------------------------------------------------------------

    def _verifier_role(self, what: str) -> bool:
        """True for verifier rank 0, False for the other verifier ranks; the drafter may not call `what`."""
        if not self.groups.is_verifier:
            raise RuntimeError(f"{what} is for verifier ranks; the drafter does not take part")
        return self.groups.tp_rank == _LEADER

    def _ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.groups.device)

    def _tp_broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=_LEADER, group=self.groups.tp_group)

    def _recv_from_leader(self, template: torch.Tensor) -> list[int]:
        """Receive into a tensor shaped like `template` (p2p on the drafter, TP broadcast on followers)."""
        tensor = template.to(self.groups.device)
        if self.groups.is_drafter:
            dist.recv(tensor, src=_LEADER)
        else:
            self._tp_broadcast(tensor)
        return tensor.tolist()

    @staticmethod
    def _check_header(header: list[int], request_ids: list[str], what: str) -> int:
        """Checks the request count and order against this side's; returns the total token count."""
        if header[0] != len(request_ids) or header[1] != ids_hash(request_ids):
            raise ValueError(
                f"{what}: the sender's {header[0]} request(s) differ from the {len(request_ids)} expected here "
                "(or come in another order); both sides must take the order from the same step plan"
            )
        if header[2] < 0:
            raise ValueError(f"{what}: corrupt sizes message {header}")
        return header[2]

    def _stack_q(self, windows: list[Drafts], total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All q rows as [total, S] tensors on the communication device."""
        id_rows = [row for window in windows for row in window.q_ids]
        prob_rows = [row for window in windows for row in window.q_probs]
        q_ids = torch.stack(id_rows).to(self.groups.device, torch.int64)
        q_probs = torch.stack(prob_rows).to(self.groups.device, torch.float32)
        if q_ids.shape != (total, self.support_size) or q_probs.shape != q_ids.shape:
            raise ValueError(
                f"q rows must have {self.support_size} entries each, got {tuple(q_ids.shape[1:])} ids "
                f"and {tuple(q_probs.shape[1:])} probabilities"
            )
        return q_ids, q_probs


def _split_windows(
    request_ids: list[str],
    counts: list[int],
    tokens: list[int],
    id_rows: list[torch.Tensor],
    prob_rows: list[torch.Tensor],
) -> dict[str, Drafts]:
    windows, offset = {}, 0
    for request_id, count in zip(request_ids, counts):
        if count == _DROPPED:
            continue
        end = offset + count
        windows[request_id] = Drafts(
            tokens=tokens[offset:end], q_ids=id_rows[offset:end], q_probs=prob_rows[offset:end]
        )
        offset = end
    return windows
