"""Proposals from text a request already has: n-gram lookup, suffix matching, and the client's prediction.

None of these runs a model. Each proposes the tokens that followed an earlier occurrence of the request's
latest tokens: in its own prompt and output (`NgramIndex`, `SuffixIndex`), in recent outputs of every request
(a shared `SuffixIndex`), or in the text the client expects (`Prediction`, OpenAI's Predicted Outputs). A
proposal is a point mass on each token (q = 1): the rejection rule accepts it with probability p(token) and at a
rejection samples from p without it, so the output is exactly the target's, greedy or sampled.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass


class NgramIndex:
    """vLLM's prompt lookup (`method: ngram`): the longest n-gram of the sequence's last n tokens
    (prompt_lookup_min <= n <= prompt_lookup_max) that occurred before, and the tokens after its latest earlier
    occurrence. Each n-gram is indexed once the token after it exists, so the sequence's own tail never matches
    itself."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # longest first
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest occurrence's next token is

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.tokens)
            for n in self.sizes:
                if n <= end:
                    self._after[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens after `context` (the indexed tokens, perhaps followed by drafts not yet verified)."""
        for n in self.sizes:
            if n <= len(context):
                start = self._after.get(tuple(context[len(context) - n :]))
                if start is not None:
                    return _continue(context, start, k)
        return []


def _continue(context: Sequence[int], start: int, k: int) -> list[int]:
    """k tokens after `context`, which repeats itself from `start` on: what followed there, and where that runs
    into the context's own end, the repetition goes on (period len(context) - start)."""
    period = len(context) - start
    return [context[start + j % period] for j in range(k)]


@dataclass
class SuffixSettings:
    """Suffix decoding's knobs, as vLLM names them (suffix_decoding_*)."""

    max_tree_depth: int = 24  # the longest match plus speculation considered
    max_spec_factor: float = 1.0  # speculate at most this many tokens per matched token
    min_token_prob: float = 0.1  # stop where the path's estimated probability falls below this
    max_occurrences: int = 256  # the latest occurrences of a match examined (a bound on a step's work)


class SuffixIndex:
    """The sequences added, and where every pair of adjacent tokens occurs in them: what a suffix tree of bounded
    depth answers, computed from occurrence lists (memory O(tokens), not O(tokens x depth)).

    `propose` finds suffixes of the context (at least two tokens, at most max_tree_depth - 1) that occur with a
    token after them, then follows the most frequent continuation of their occurrences, token by token, while the
    product of each choice's frequency stays at least min_token_prob; its score (the sum of those products) is the
    tokens it expects accepted (Suffix Decoding, Oliaro et al. 2024). A match and its speculation together stay
    within max_tree_depth, as in a suffix tree of that depth."""

    def __init__(self, settings: SuffixSettings) -> None:
        self.settings = settings
        self.sequences: dict[int, list[int]] = {}
        self._where: dict[tuple[int, int], list[tuple[int, int]]] = {}  # pair -> (sequence, index after it)
        self._stale = 0  # entries of removed sequences still in _where
        self._entries = 0

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        seq = self.sequences.setdefault(seq_id, [])
        for token in tokens:
            if len(seq) >= 2:
                self._where.setdefault((seq[-2], seq[-1]), []).append((seq_id, len(seq)))
                self._entries += 1
            seq.append(token)

    def remove(self, seq_id: int) -> None:
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            return
        self._stale += max(0, len(seq) - 2)
        if self._stale * 2 > self._entries:  # most entries are dead: rebuild the lists of the living
            living = {pair: [e for e in entries if e[0] in self.sequences] for pair, entries in self._where.items()}
            self._where = {pair: entries for pair, entries in living.items() if entries}
            self._entries -= self._stale
            self._stale = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences.values())

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], float]:
        """Up to k tokens after `context`, and the number of them expected to be accepted. Of the longest match
        and the longest that leaves room for k tokens within max_tree_depth, the one whose path scores more."""
        if len(context) < 2 or k <= 0:
            return [], 0.0
        matches = self._matches(context)
        if not matches:
            return [], 0.0
        longest = max(n for n, _, _ in matches)
        best: tuple[list[int], float] = ([], 0.0)
        for length in sorted({longest, max(2, min(longest, self.settings.max_tree_depth - k))}):
            found = [(seq, after) for n, seq, after in matches if n >= length]
            path = self._follow(found, length, k)
            if path[1] > best[1]:
                best = path
        return best

    def _follow(self, found: list[tuple[list[int], int]], length: int, k: int) -> tuple[list[int], float]:
        """The most frequent continuation of a match of `length` tokens at `found`, and its score."""
        s = self.settings
        limit = min(k, int(s.max_spec_factor * length), s.max_tree_depth - length)
        tokens, prob, score = [], 1.0, 0.0
        for step in range(limit):
            nexts = Counter(seq[i + step] for seq, i in found if i + step < len(seq))
            if not nexts:
                break
            token, count = nexts.most_common(1)[0]
            prob *= count / sum(nexts.values())
            if prob < s.min_token_prob:
                break
            tokens.append(token)
            score += prob
            found = [(seq, i) for seq, i in found if i + step < len(seq) and seq[i + step] == token]
        return tokens, score

    def _matches(self, context: Sequence[int]) -> list[tuple[int, list[int], int]]:
        """(match length, sequence, index of the token after it) for the latest occurrences of the context's last
        two tokens that have a token after them; a match runs back at most max_tree_depth - 1 tokens."""
        entries = self._where.get((context[-2], context[-1]))
        if not entries:
            return []
        most = min(len(context), self.settings.max_tree_depth - 1)
        matches = []
        for seq_id, after in entries[-self.settings.max_occurrences :]:
            seq = self.sequences.get(seq_id)
            if seq is None or after >= len(seq):
                continue
            n = 2
            while n < most and n < after and seq[after - n - 1] == context[-n - 1]:
                n += 1
            matches.append((n, seq, after))
        return matches


class SharedSuffixes:
    """The global side of suffix decoding: the outputs of the latest requests, first in first out, bounded in
    requests (suffix_decoding_max_cached_requests; 0 = off) and in tokens."""

    def __init__(self, settings: SuffixSettings, max_requests: int, max_tokens: int) -> None:
        self.index = SuffixIndex(settings)
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self._order: deque[tuple[int, int]] = deque()  # (sequence id, tokens)
        self._tokens = 0
        self._next_id = 0

    def add(self, output: Sequence[int]) -> None:
        if self.max_requests <= 0 or not output:
            return
        output = list(output[-self.max_tokens :])
        self.index.extend(self._next_id, output)
        self._order.append((self._next_id, len(output)))
        self._next_id += 1
        self._tokens += len(output)
        while len(self._order) > self.max_requests or self._tokens > self.max_tokens:
            seq_id, n = self._order.popleft()
            self.index.remove(seq_id)
            self._tokens -= n


class Prediction:
    """The client's predicted output (OpenAI's Predicted Outputs) and where the output stands in it.

    The output starts at the prediction's start. While each new token is the one the prediction has next, the
    cursor moves on; after a token it does not have (an edit), the cursor is lost until the output's last tokens
    occur in the prediction again (at least two: the longest such match, the one nearest ahead of where the
    cursor was on a tie), as suffix matching would re-align."""

    MAX_REALIGN = 32  # the longest tail of the output compared when re-aligning

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.cursor: int | None = 0  # the index of the prediction's token expected next (None: lost)
        self.matched = 0  # output tokens that were the prediction's next token
        self.output: list[int] = []
        self._after: dict[tuple[int, int], list[int]] = {}
        for i in range(2, len(self.tokens)):
            self._after.setdefault((self.tokens[i - 2], self.tokens[i - 1]), []).append(i)
        self._last = 0  # where the cursor was last found

    def extend(self, output_tokens: Sequence[int]) -> None:
        for token in output_tokens:
            self.output.append(token)
            if self.cursor is not None and self.cursor < len(self.tokens) and self.tokens[self.cursor] == token:
                self.cursor += 1
                self.matched += 1
            else:
                self.cursor = self._realign()
            if self.cursor is not None:
                self._last = self.cursor

    def propose(self, k: int, drafted: Sequence[int] = ()) -> list[int]:
        """Up to k tokens the prediction has next, after `drafted` (a window not yet verified) if it follows it."""
        if self.cursor is None:
            return []
        start = self.cursor + len(drafted)
        if drafted and self.tokens[self.cursor : start] != list(drafted):
            return []
        return self.tokens[start : start + k]

    def _realign(self) -> int | None:
        out = self.output
        if len(out) < 2:
            return None
        best, at = 0, None
        for after in self._after.get((out[-2], out[-1]), ()):
            n = 2
            while n < self.MAX_REALIGN and n < after and n < len(out) and self.tokens[after - n - 1] == out[-n - 1]:
                n += 1
            if n > best or n == best and at is not None and _nearer(after, at, self._last):
                best, at = n, after
        return at

    @property
    def usage(self) -> tuple[int, int]:
        """(accepted, rejected) prediction tokens, as OpenAI counts them: those the output holds where the prediction
        had them, and the rest of the prediction."""
        return self.matched, len(self.tokens) - self.matched


def _nearer(candidate: int, current: int, last: int) -> bool:
    """Whether `candidate` is a better re-alignment than `current` for a cursor last at `last`: ahead of it
    rather than behind, then closer."""
    key = lambda i: (i < last, abs(i - last))  # noqa: E731
    return key(candidate) < key(current)


def prediction_usage(prediction: Sequence[int], output: Sequence[int]) -> tuple[int, int]:
    """(accepted_prediction_tokens, rejected_prediction_tokens) of a finished output."""
    cursor = Prediction(prediction)
    cursor.extend(output)
    return cursor.usage
