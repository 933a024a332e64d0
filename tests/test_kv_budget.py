"""KV-cache sizing: defaults that do not take max_num_seqs x max_model_len up front, and long contexts."""

from __future__ import annotations

from pathlib import Path

import pytest

from minedraft import LLM, SamplingParams
from minedraft.model.kv_cache import CPU_DEFAULT_KV_BYTES

from tiny_models import make_tiny_checkpoint

LONG_CONTEXT = 131_072


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_a_131072_token_checkpoint_loads_and_runs_with_default_settings(tmp_path) -> None:
    """The old cache took max_num_seqs x max_model_len up front (here 16 x 131,072 tokens, 2 GiB, all
    written with zeros). The paged pool is bounded by the budget and touches only the blocks it hands out."""
    path = make_tiny_checkpoint(tmp_path / "long", "qwen3", num_layers=2, max_position_embeddings=LONG_CONTEXT)
    before = _resident_bytes()
    with LLM(str(path), device="cpu") as llm:
        cache = llm.engine.executor.verifier.runner.kv_cache
        pool_bytes = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
        assert llm.engine.max_model_len == LONG_CONTEXT
        assert pool_bytes <= CPU_DEFAULT_KV_BYTES + cache.block_size * 1024  # the budget, plus the zero block
        assert cache.num_blocks * cache.block_size >= LONG_CONTEXT  # room for one request of the whole context
        out = llm.generate([[5, 6, 7], [8] * 40], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [12, 12]
        assert _resident_bytes() - before < pool_bytes // 4, "the pool must not be touched up front"
        assert cache.num_free_blocks == cache.num_blocks
