"""The acceptance model: per draft position, the chance its token is accepted when every one before it was, from
decayed counts over all verifications, scaled per request by its own acceptance so far (docs/engine.md,
"Adaptive speculation: step shapes and k")."""

from __future__ import annotations

from collections.abc import Sequence

from minedraft.engine.adaptive.fits import DECAY
from minedraft.engine.request import Request

_REQUEST_PRIOR = 6.0  # the global acceptance's weight in a request's, in verifications; docs/engine.md#tuning-constants
_REQUEST_FADE = 0.8  # what a request's verifications keep per step it runs plainly; docs/engine.md#tuning-constants
_MAX_ACCEPT = 0.995  # the most any position's chance may be; docs/engine.md#tuning-constants


class Acceptance:
    """Per draft position j: the chance it is accepted when positions 0..j-1 were (decayed counts)."""

    def __init__(self, max_k: int) -> None:
        self.reached = [0.0] * max_k
        self.accepted = [0.0] * max_k
        self.samples = 0  # windows recorded: the estimate changes with each, and with nothing else

    def decay(self) -> None:
        self.reached = [n * DECAY for n in self.reached]
        self.accepted = [n * DECAY for n in self.accepted]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.samples += 1
        for j in range(min(num_accepted + 1, num_drafts, len(self.reached))):
            self.reached[j] += 1
            self.accepted[j] += j < num_accepted

    def conditional(self) -> list[float]:
        """Each position's estimate, leaning on the position before it while it has few counts (two pseudo-counts
        at the previous position's rate), and optimistic before any (a rate of 1): plain steps verify no drafts,
        so an estimate that starts low would keep drafting off until a probe, while one that starts high drafts
        until the windows show that drafting does not pay, which a useless draft shows within a few steps."""
        rates, prior = [], 1.0
        for reached, accepted in zip(self.reached, self.accepted):
            prior = (accepted + 2 * prior) / (reached + 2)
            rates.append(prior)
        return rates

    def overall(self) -> float:
        """Accepted over reached, all positions together."""
        return (sum(self.accepted) + 1) / (sum(self.reached) + 2)

    def survival(self, requests: Sequence[Request], own_evidence: bool = True) -> list[list[float]]:
        """For each request, the chance that each of its first max_k draft tokens is accepted: the positions'
        rates scaled by the request's own acceptance over the global one, its own shrunk towards the global by
        _REQUEST_PRIOR verifications and faded by _REQUEST_FADE per plain step it ran (`own_evidence` False: as
        if it had verified nothing yet); each position's chance at most _MAX_ACCEPT."""
        overall, rates = self.overall(), self.conditional()
        survival = []
        for request in requests:
            fade = _REQUEST_FADE**request.plain_steps if own_evidence else 0.0
            accepted, rejections = fade * request.stats.num_accepted_tokens, fade * request.num_rejections
            own = (accepted + _REQUEST_PRIOR * overall) / (accepted + rejections + _REQUEST_PRIOR)
            scale, chance, chances = own / overall, 1.0, []
            for rate in rates:
                chance *= min(_MAX_ACCEPT, rate * scale)
                chances.append(chance)
            survival.append(chances)
        return survival
