"""Adaptive speculation: the shape of each step and how many tokens each request drafts in it, from what was
measured here.

Two online models (docs/engine.md, "Adaptive speculation: step shapes and k"):

- acceptance: the chance that the draft token at position j is accepted when every one before it was,
  from decayed counts over all verifications, scaled per request by its own acceptance so far (shrunk
  towards the global figure while it has few verifications);
- cost, per load (running requests, by powers of four): the seconds of a verify part as a + c x requests + b x
  target tokens, of a draft part as e + c' x draft forwards + d x draft tokens, each fitted twice: for a part that
  ran alone (plain steps, the halves of a one-batch step) and for one that ran beside the other part (overlapped
  steps; on one CPU the two share its cores), and each step's overhead beyond its parts (planning, transport, the
  engine's bookkeeping, and for overlapped steps the wait at their synchronisation point), per shape, from the
  wall time between results; least squares with forgetting over the work the workers report (StepResult), so
  nothing is tuned for one machine.

Each decision takes, of the shapes the mode allows (plain decoding; one batch that drafts, then is verified;
drafting beside verification), the one with the fewest seconds per token: predicted for the requests running now,
with the k in 1..max with the most expected tokens per second and each request's window trimmed where its next
token is expected to be worth less than it costs, times what the shape's steps took at this load against what the
model predicted for them (measured in runs, tried now and then: `Trials`), since a step costs more than its parts
in ways the model does not see; a speculative shape also pays, spread over the tokens its requests have left, the
catch-up the drafter owes them (what it has not read of them) before it can draft. The choice reads only
verifications already made, never the token about to be sampled, so every output stays exactly the target's.
Requests that sample with a seed keep the mode's own shape and the fixed k, so that their text is the same on
every run.

The package's modules: `shapes` (what a decision is about), `acceptance` and `costs` (the two models), `fits`
(the online fits they rest on), `trials` (a choice measured in runs and probes), `controller` (the decisions),
and `threads` (a worker's thread count per kind of step, chosen by trials too).
"""

from minedraft.engine.adaptive.acceptance import Acceptance
from minedraft.engine.adaptive.controller import SpeculationController
from minedraft.engine.adaptive.costs import Costs, PartCosts
from minedraft.engine.adaptive.shapes import Candidates, Decision, Shape, StepChoice, load_kind, seeded_sampling

__all__ = ["Acceptance", "Candidates", "Costs", "Decision", "PartCosts", "Shape", "SpeculationController",
           "StepChoice", "load_kind", "seeded_sampling"]
