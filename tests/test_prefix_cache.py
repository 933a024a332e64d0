"""Automatic prefix caching: the block index and its eviction, reuse across requests in every mode,
reuse under preemption, and a new world starting with an empty cache.

The engine tests run the strict kernels, so a reused block holds exactly the keys and values a fresh
prefill would write, and outputs with and without the cache must be equal token for token.
"""

from __future__ import annotations

import random

import pytest
import torch

from minedraft.bench.server_metrics import ServerStepStats
from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.engine.engine import LLMEngine
from minedraft.engine.plans import Admission, VerifyPlan, VerifyTask
from minedraft.engine.workers import VerifyWorker
from minedraft.metrics import scrape
from minedraft.model.kv_cache import KVCache, bytes_per_block
from minedraft.model.runner import ModelRunner, SeqInput
from minedraft.sampling.params import SamplingParams
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

from conftest import tiny_config

BLOCK = 4


def _cache(num_blocks: int = 8, enable: bool = True) -> KVCache:
    return KVCache(num_layers=1, num_blocks=num_blocks, block_size=BLOCK, num_kv_heads=1, head_dim=2,
                   dtype=torch.float32, device="cpu", enable_prefix_caching=enable)  # fmt: skip


def _finished(cache: KVCache, tokens: list[int]) -> list[int]:
    """A sequence that held `tokens`, offered them all to the index and ended; returns its blocks."""
    seq = cache.allocate()
    cache.fit(seq, len(tokens))
    blocks = list(cache.block_tables[seq])
    cache.cache_prefix(seq, tokens, len(tokens))
    cache.free(seq)
    return blocks


def _reuse(cache: KVCache, tokens: list[int]) -> tuple[int, int]:
    seq = cache.allocate()
    return seq, cache.reuse_prefix(seq, tokens)


def test_a_later_sequence_takes_the_full_blocks_it_starts_with() -> None:
    cache = _cache()
    blocks = _finished(cache, list(range(10)))  # two full blocks and a partial one
    seq, hit = _reuse(cache, list(range(10)) + [99, 98])
    assert hit == 8 and cache.block_tables[seq] == blocks[:2] and cache.lengths[seq] == 8
    assert cache.take_prefix_stats() == (12, 8)
    assert cache.take_prefix_stats() == (0, 0), "the counters are taken, not read"


def test_the_last_token_is_always_computed_again() -> None:
    """Its logits are what the next step samples from: a block that ends at the last token is not taken."""
    cache = _cache()
    _finished(cache, list(range(8)))
    assert _reuse(cache, list(range(8)))[1] == 4
    assert _reuse(cache, list(range(9)))[1] == 8


def test_blocks_are_matched_as_a_chain_not_one_by_one() -> None:
    """Equal tokens after a different prefix hold different keys and values: no match."""
    cache = _cache()
    _finished(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert _reuse(cache, [0, 2, 3, 4, 5, 6, 7, 8, 9])[1] == 0
    assert _reuse(cache, [1, 2, 3, 4, 0, 6, 7, 8, 9])[1] == 4


def test_shared_blocks_are_counted_per_holder_and_freed_by_the_last() -> None:
    cache = _cache(num_blocks=4)
    _finished(cache, list(range(9)))
    assert cache.num_free_blocks == 4, "cached blocks no sequence holds count as free"
    a, _ = _reuse(cache, list(range(9)))
    b, _ = _reuse(cache, list(range(9)))
    assert cache.block_tables[a] == cache.block_tables[b] and cache.num_free_blocks == 2
    cache.free(a)
    assert cache.num_free_blocks == 2, "b still holds the shared blocks"
    cache.free(b)
    assert cache.num_free_blocks == 4


def test_eviction_takes_the_least_recently_used_block_and_only_when_nothing_is_free() -> None:
    cache = _cache(num_blocks=4)
    _finished(cache, [1] * 5)  # block [1,1,1,1]
    _finished(cache, [2] * 5)
    _finished(cache, [3] * 5)
    seq, hit = _reuse(cache, [1] * 5)  # touch the oldest: it becomes the most recently used
    assert hit == 4
    cache.free(seq)
    new = cache.allocate()
    cache.fit(new, 8)  # two blocks: the one never-cached block, then the least recently used cached one ([2]*4)
    assert cache.num_free_blocks == 2
    assert _reuse(cache, [2] * 5)[1] == 0, "the least recently used entry was evicted"
    assert _reuse(cache, [3] * 5)[1] == 4 and _reuse(cache, [1] * 5)[1] == 4


def test_a_chain_loses_its_tail_before_its_head() -> None:
    """A finished sequence's blocks become evictable last block first: what stays is still a prefix."""
    cache = _cache(num_blocks=3)
    _finished(cache, list(range(9)))  # two full blocks cached, the partial third one free
    seq = cache.allocate()
    cache.fit(seq, 8)  # the free block, then one eviction
    assert _reuse(cache, list(range(9)))[1] == 4


def test_without_prefix_caching_nothing_is_kept() -> None:
    cache = _cache(enable=False)
    _finished(cache, list(range(10)))
    assert _reuse(cache, list(range(10)))[1] == 0 and cache.take_prefix_stats() == (0, 0)


def test_clearing_forgets_everything_and_needs_no_sequence_held() -> None:
    cache = _cache()
    _finished(cache, list(range(10)))
    seq, _ = _reuse(cache, list(range(10)))
    with pytest.raises(RuntimeError, match="still hold blocks"):
        cache.clear_prefix_cache()
    cache.free(seq)
    cache.clear_prefix_cache()
    assert _reuse(cache, list(range(10)))[1] == 0 and cache.num_free_blocks == cache.num_blocks


def test_a_cached_prefix_is_never_written_again(pair) -> None:
    runner = ModelRunner(pair[0], max_seq_len=32, num_slots=2, block_size=BLOCK, enable_prefix_caching=True)
    first = runner.allocate_slot()
    runner.forward([SeqInput(first, list(range(10)), 0)])
    runner.kv_cache.cache_prefix(first, list(range(10)), 8)
    with pytest.raises(ValueError, match="would overwrite its cached prefix of 8 tokens"):
        runner.forward([SeqInput(first, [5, 6], 7)])


# --- engines: the same outputs with and without the cache, and the cache is really used ---------------

# Fixed k: the drafter's cache is tested too, and adaptive speculation may rightly leave a random draft idle.
SPECS = {
    "ar": None,
    "sd": {"num_speculative_tokens": 3, "adaptive": False},
    "pearl": {"num_speculative_tokens": 3, "is_parallel": True, "force_pearl": True, "adaptive": False},
    "minedraft": {"num_speculative_tokens": 3, "is_parallel": True, "adaptive": False},
}


def _conversations(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts sharing a 37-token system prompt, some sharing a user turn after it too."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(37)]
    turns = [[rng.randrange(vocab) for _ in range(rng.choice([3, 9, 20]))] for _ in range(n // 2)]
    return [system + turns[i % len(turns)] + [rng.randrange(vocab) for _ in range(i % 4)] for i in range(n)]


def _serve(config: EngineConfig, rounds: list[list[list[int]]], max_tokens: int = 12) -> tuple[list, LLMEngine]:
    """Each round's prompts at once, the rounds one after the other; the outputs of every round."""
    engine = LLMEngine.local(config, max_in_flight=2)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = []
    try:
        for prompts in rounds:
            requests = [engine.add_request(p, params) for p in prompts]
            while engine.has_unfinished() or engine.in_flight:
                engine.advance()
            outputs.append([r.output_ids for r in requests])
    finally:
        engine.executor.close()
    return outputs, engine


@pytest.mark.parametrize("mode", list(SPECS))
def test_outputs_are_the_same_with_and_without_the_cache(pair, mode: str) -> None:
    vocab = ModelRunner(pair[0], max_seq_len=8).config.vocab_size
    prompts = _conversations(vocab, 8, seed=1)
    second = [p + [1, 2, 3] for p in prompts]  # the next turn of each conversation
    rounds = [prompts, second]
    base = {"max_num_seqs": 4, "block_size": 8}
    expected, _ = _serve(tiny_config(pair, SPECS[mode], enable_prefix_caching=False, **base), rounds)
    got, engine = _serve(tiny_config(pair, SPECS[mode], **base), rounds)
    assert got == expected
    stats = engine.step_stats
    for role in ("verifier", "drafter") if SPECS[mode] else ("verifier",):
        assert stats.prefix_cache_queries[role] == sum(len(p) for p in prompts + second)
        # At least: every second turn finds the full blocks of its first turn, which ended before it came.
        assert stats.prefix_cache_hits[role] >= sum(len(p) // 8 * 8 for p in prompts)


def test_reused_blocks_under_preemption(pair) -> None:
    """A pool with room for about three requests: preempted requests come back to their own cached blocks
    (or to another's shared prompt); outputs equal those without caching, and every block is free at the end."""
    target = pair[0]
    config = ModelRunner(target, max_seq_len=8).config
    vocab = config.vocab_size
    budget = 24 * bytes_per_block(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 8,
                                  torch.float32)
    prompts = _conversations(vocab, 12, seed=2)
    base = {"max_num_seqs": 6, "block_size": 8, "kv_cache_memory_bytes": budget}
    spec = SPECS["minedraft"]
    expected, _ = _serve(tiny_config(pair, spec, enable_prefix_caching=False, **base), [prompts], max_tokens=40)
    got, engine = _serve(tiny_config(pair, spec, **base), [prompts], max_tokens=40)
    assert engine.num_preemptions > 0, "the budget is meant to force preemption"
    assert got == expected
    assert engine.step_stats.prefix_cache_hits["verifier"] > 0
    for worker in (engine.executor.verifier, engine.executor.drafter):
        assert worker.runner.kv_cache.num_free_blocks == worker.runner.kv_cache.num_blocks


def test_a_new_world_starts_with_an_empty_cache(pair) -> None:
    """A worker reset (a new world, a new scheduler) forgets the cache: nothing computed before is reused."""
    worker = VerifyWorker(ModelRunner(pair[0], max_seq_len=64, num_slots=2, block_size=BLOCK,
                                      enable_prefix_caching=True))  # fmt: skip
    tokens = list(range(1, 20))
    params = SamplingParams(temperature=0, max_tokens=4)

    def serve_once(request_id: str) -> int:
        worker.admit([Admission(request_id, tokens, params, seed=0)])
        hit = len(worker.sequences[request_id].kv_tokens)
        worker.verify(VerifyPlan([VerifyTask(request_id)]))
        worker.release([request_id])
        return hit

    assert serve_once("a") == 0
    assert serve_once("b") == 16, "the second request reuses the first one's full blocks"
    worker.reset()
    assert serve_once("c") == 0


def test_served_hits_reach_the_metrics_and_the_server_info(pair, tmp_path) -> None:
    """The workers' counts travel in their step replies: a repeated prompt shows as hits on /metrics, under
    our names and vLLM's, and in the bench's server section; GetServerInfo reports the setting."""
    metrics_port = free_port()
    config = tiny_config(pair, SPECS["sd"], max_num_seqs=2)
    settings = scheduler_settings(metrics_port=metrics_port)
    prompt = list(range(3, 60))
    with LocalStack(config, scheduler=settings, log_dir=tmp_path) as stack, Client(stack.address) as client:
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        before = scrape(url)
        first = client.generate(prompt, max_tokens=6, temperature=0).token_ids
        second = client.generate(prompt, max_tokens=6, temperature=0).token_ids
        after = scrape(url)
        info = client.server_info()
    assert first == second and info.enable_prefix_caching and (info.quantization, info.draft_quantization) == ("", "")
    stats = ServerStepStats.from_scrapes(before, after)
    assert stats.prefix_cache_queries == 2 * len(prompt)
    assert stats.prefix_cache_hits == (len(prompt) - 1) // 16 * 16, "the second request finds the first's blocks"
    assert after["vllm:prefix_cache_hits_total"] == after["minedraft:prefix_cache_hits_total"]
    assert after["minedraft:draft_prefix_cache_hits_total"] == stats.prefix_cache_hits


def test_blocks_computed_side_by_side_end_up_as_one() -> None:
    """Two sequences that wrote the same prompt in one step (neither could reuse the other's) share the block
    indexed first once both are indexed: the copy goes back to the pool."""
    cache = _cache()
    tokens = list(range(10))
    first, second = cache.allocate(), cache.allocate()
    for seq in (first, second):
        cache.fit(seq, len(tokens))
    assert cache.num_free_blocks == 8 - 6
    for seq in (first, second):
        cache.cache_prefix(seq, tokens, 9)
    assert cache.block_tables[second][:2] == cache.block_tables[first][:2]
    assert cache.num_free_blocks == 8 - 4
    cache.free(first)
    cache.free(second)
    assert cache.num_free_blocks == 8 and _reuse(cache, tokens)[1] == 8


def _serve_in_24_blocks(pair, mode: str, prompts: list[list[int]], max_tokens: int,
                        enable: bool) -> tuple[list[list[int]], int, LLMEngine]:
    """Serve `prompts` at once with a verifier pool of 24 blocks of 8 tokens: (outputs, the most requests that
    ran at once, the engine). No request fails, and every block is free at the end."""
    config = ModelRunner(pair[0], max_seq_len=8).config
    per_block = bytes_per_block(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 8, torch.float32)
    base = {"max_num_seqs": 8, "block_size": 8, "kv_cache_memory_bytes": 24 * per_block}
    engine = LLMEngine.local(tiny_config(pair, SPECS[mode], enable_prefix_caching=enable, **base), max_in_flight=2)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        requests = [engine.add_request(p, params) for p in prompts]
        most = 0
        while engine.has_unfinished() or engine.in_flight:
            engine.advance()
            most = max(most, engine.pipeline.batches.num_running)
        assert all(r.finish_reason == "length" for r in requests), [r.error for r in requests]
        verifier = engine.executor.verifier.runner.kv_cache
        assert verifier.num_free_blocks == verifier.num_blocks
        return [r.output_ids for r in requests], most, engine
    finally:
        engine.executor.close()


def _shared_system_prompt(pair, n: int) -> list[list[int]]:
    vocab = ModelRunner(pair[0], max_seq_len=8).config.vocab_size
    rng = random.Random(3)
    system = [rng.randrange(vocab) for _ in range(64)]
    return [system + [rng.randrange(vocab) for _ in range(6)] for _ in range(n)]


@pytest.mark.parametrize("mode", ["ar", "minedraft"])
def test_admission_charges_a_shared_prompt_once(pair, mode: str) -> None:
    """A pool that holds two of these conversations charged in full: sharing their system prompt, more run
    at once, and outputs equal those without caching."""
    prompts = _shared_system_prompt(pair, 8)
    expected, alone, _ = _serve_in_24_blocks(pair, mode, prompts, 16, enable=False)
    got, shared, _ = _serve_in_24_blocks(pair, mode, prompts, 16, enable=True)
    assert got == expected
    assert alone <= 2 and shared >= 4, (alone, shared)


def test_requests_admitted_together_grow_into_the_blocks_their_shared_prompt_frees(pair) -> None:
    """Two requests that computed the same system prompt in one step: once it is indexed they hold it once,
    and admission lets them grow into what that freed (28 blocks in full, 20 shared) with no preemption."""
    prompts = _shared_system_prompt(pair, 2)
    expected, _, alone = _serve_in_24_blocks(pair, "ar", prompts, 40, enable=False)
    got, _, shared = _serve_in_24_blocks(pair, "ar", prompts, 40, enable=True)
    assert got == expected
    assert alone.num_preemptions > 0 and shared.num_preemptions == 0


def test_prompt_tokens_count_what_the_cache_lacks(pair) -> None:
    """What the verifier's thread choice reads a step's kind from: a starting request's prompt, less what the
    prefix cache holds, and nothing once it decodes."""
    worker = VerifyWorker(ModelRunner(pair[0], max_seq_len=64, num_slots=2, block_size=BLOCK,
                                      enable_prefix_caching=True))  # fmt: skip
    tokens = list(range(1, 20))
    params = SamplingParams(temperature=0, max_tokens=4)
    worker.admit([Admission("a", tokens, params, seed=0)])
    plan = VerifyPlan([VerifyTask("a")])
    assert worker.prompt_tokens(plan) == len(tokens) - 1 and worker.held_tokens(plan) == 1
    worker.verify(plan)
    assert worker.prompt_tokens(plan) == 0, "decoding feeds one token a request"
    worker.admit([Admission("b", tokens, params, seed=0)])
    assert worker.prompt_tokens(VerifyPlan([VerifyTask("a"), VerifyTask("b")])) == len(tokens) - 1 - 16
