"""A request re-admitted mid-way draws exactly the tokens it would have drawn.

Every random draw is keyed by (request seed, output position), so a request that is re-admitted with
its prompt plus the k tokens it already had (after a worker failure, a preemption or a migration),
with the same seed, continues with exactly the remaining tokens of the undisturbed run, with
temperature > 0. Re-admission happens where a real one happens: after a step that committed tokens.
The strict kernels (`batch_invariant=True`) make the logits independent of batch shape and prefill
length, so the resumed run may also have different neighbours in its batch.

The speculative modes run with adaptive k on (the default): requests that sample with a seed keep the
fixed k (windows chosen from measured times would move where windows start, and with them the draws).
"""

from __future__ import annotations

import pytest

from minedraft.config import EngineConfig
from minedraft.engine.engine import LLMEngine
from minedraft.sampling.params import SamplingParams

PROMPTS = [[5, 17, 42], [7, 7, 1, 300, 2], [99]]
MAX_TOKENS = 24
MODES = {
    "ar": None,
    "sd": {"num_speculative_tokens": 3},
    "minedraft": {"num_speculative_tokens": 3, "is_parallel": True},
}


# conftest's `pair` from this seed: the draft is the target's first layer, close enough that windows are
# accepted in part.
PAIR_SEED = 3


def _engine(pair, spec) -> LLMEngine:
    target, draft = pair
    config = EngineConfig(
        model=str(target),
        speculative_config={**spec, "model": str(draft)} if spec else None,
        max_num_seqs=8,
        max_model_len=64,
        device="cpu",
        batch_invariant=True,
        draft_support_size=8,
    )
    return LLMEngine.local(config)


def _params(seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(0.8, top_k=40, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def _run(engine: LLMEngine, prompts: list[list[int]], seeds: list[int], max_tokens: list[int]):
    """Outputs, and for each request the output lengths after each step that gave it tokens."""
    requests = [engine.add_request(p, _params(s, m)) for p, s, m in zip(prompts, seeds, max_tokens)]
    boundaries: list[list[int]] = [[] for _ in requests]
    while engine.has_unfinished():
        touched = engine.step()
        for i, r in enumerate(requests):
            if r in touched and len(r.output_ids) < max_tokens[i]:
                boundaries[i].append(len(r.output_ids))
    return [list(r.output_ids) for r in requests], boundaries


@pytest.mark.parametrize("mode", list(MODES))
def test_readmitted_request_continues_with_the_same_sampled_tokens(pair, mode) -> None:
    seeds = [11, 12, 13]
    engine = _engine(pair, MODES[mode])
    try:
        outputs, boundaries = _run(engine, PROMPTS, seeds, [MAX_TOKENS] * 3)
        assert len({tuple(o) for o in outputs}) == 3
        for i in (0, 1):
            cuts = sorted(set(boundaries[i]))
            assert len(cuts) >= 3, cuts
            for k in cuts[:: max(1, len(cuts) // 4)]:
                # Alone, or beside a new neighbour: the remaining tokens are the undisturbed ones.
                prompts = [PROMPTS[i] + outputs[i][:k], PROMPTS[2]]
                resumed, _ = _run(engine, prompts, [seeds[i], 99], [MAX_TOKENS - k, 5])
                assert resumed[0] == outputs[i][k:], (i, k)
    finally:
        engine.executor.close()


def test_another_seed_draws_other_tokens(pair) -> None:
    engine = _engine(pair, MODES["sd"])
    try:
        outputs, _ = _run(engine, [PROMPTS[0]] * 2, [1, 2], [MAX_TOKENS] * 2)
        assert outputs[0] != outputs[1]
    finally:
        engine.executor.close()
