"""ModelRunner logits against Hugging Face transformers on tiny random checkpoints (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from minedraft.model.runner import ModelRunner, SeqInput

from tiny_models import load_hf_model, make_tiny_checkpoint, torch_threads

ATOL, RTOL = 1e-4, 1e-5

# arch -> checkpoint options: GQA, MQA and MHA; qwen3 has head_dim != hidden / heads and tied embeddings;
# qwen3_moe routes each token to 2 of 4 experts.
CASES = {
    "llama": {"num_heads": 4, "num_kv_heads": 1},
    "llama3": {"num_heads": 4, "num_kv_heads": 2},
    "qwen2": {"num_heads": 4, "num_kv_heads": 2},
    "qwen3": {"num_heads": 4, "num_kv_heads": 2},
    "qwen3_moe": {"num_heads": 4, "num_kv_heads": 2},  # layer 0 routed experts, layer 1 dense (tiny_models)
}
KERNELS = {"invariant": True, "sdpa": False}


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_tiny_checkpoint(root / arch, arch, seed=i, **kw) for i, (arch, kw) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    return {arch: load_hf_model(path) for arch, path in checkpoints.items()}


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def tokens(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def runner(path, kernel: str, **kwargs) -> ModelRunner:
    opts = {"num_slots": 4, "max_seq_len": 256, "batch_invariant": KERNELS[kernel]} | kwargs
    return ModelRunner(path, **opts)


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", CASES)
def test_prefill_matches_hf(checkpoints, hf_models, arch, kernel):
    r = runner(checkpoints[arch], kernel)
    ids = tokens(90, seed=1)  # > 64: crosses llama3's original context length
    slot = r.allocate_slot()
    assert_close(r.forward([SeqInput(slot, ids, 0, num_logits=len(ids))]), hf_logits(hf_models[arch], ids))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", CASES)
def test_mixed_batch_matches_hf(checkpoints, hf_models, arch, kernel):
    """A prefill, a 5-token verification and a decode in one forward; each row checked against HF."""
    r, hf = runner(checkpoints[arch], kernel), hf_models[arch]
    a, b, c = tokens(70, seed=2), tokens(40, seed=3), tokens(12, seed=4)
    sa, sb, sc = (r.allocate_slot() for _ in range(3))
    r.forward([SeqInput(sb, b[:35], 0), SeqInput(sc, c[:11], 0)])
    out = r.forward(
        [SeqInput(sc, c[11:], 11), SeqInput(sa, a, 0, num_logits=3), SeqInput(sb, b[35:], 35, num_logits=5)]
    )
    assert out.shape == (1 + 3 + 5, 320)
    assert_close(out[0:1], hf_logits(hf, c)[-1:])
    assert_close(out[1:4], hf_logits(hf, a)[-3:])
    assert_close(out[4:9], hf_logits(hf, b)[-5:])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", CASES)
def test_decode_after_rollback_matches_hf(checkpoints, hf_models, arch, kernel):
    """Write 4 drafts, keep 1 (rollback via start_pos), write other tokens, then decode one at a time."""
    r, hf = runner(checkpoints[arch], kernel), hf_models[arch]
    prompt, drafts, fixed = tokens(30, seed=5), tokens(4, seed=6), tokens(8, seed=7)
    slot = r.allocate_slot()
    r.forward([SeqInput(slot, prompt, 0)])
    r.forward([SeqInput(slot, drafts, len(prompt), num_logits=4)])
    seq = prompt + drafts[:1]
    out = [r.forward([SeqInput(slot, fixed[:3], len(seq), num_logits=3)])]
    seq += fixed[:3]
    for t in fixed[3:]:
        out.append(r.forward([SeqInput(slot, [t], len(seq))]))
        seq.append(t)
    assert_close(torch.cat(out), hf_logits(hf, seq)[len(prompt) + 1 :])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_attention_over_scattered_slots_matches_hf(checkpoints, hf_models, arch):
    """The fast kernel gathers each sequence's blocks from the pool: sequences whose blocks interleave with
    others that are not in the batch (here 1 and 3), and a batch out of allocation order."""
    r, hf = runner(checkpoints[arch], "sdpa", num_slots=5), hf_models[arch]
    seqs = {slot: tokens(n, seed=20 + slot) for slot, n in zip(range(5), (17, 3, 40, 9, 26))}
    for slot in range(5):
        assert r.allocate_slot() == slot
        r.forward([SeqInput(slot, seqs[slot][:-2], 0)])
    out = r.forward([SeqInput(4, seqs[4][-2:], len(seqs[4]) - 2, num_logits=2), SeqInput(0, seqs[0][-2:-1], 15),
                     SeqInput(2, seqs[2][-2:], 38, num_logits=2)])  # fmt: skip
    assert_close(out[0:2], hf_logits(hf, seqs[4])[-2:])
    assert_close(out[2:3], hf_logits(hf, seqs[0][:-1])[-1:])
    assert_close(out[3:5], hf_logits(hf, seqs[2])[-2:])


def test_sharded_checkpoint_matches_hf(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "sharded", "qwen2", num_heads=4, num_kv_heads=4, max_shard_size="20KB")
    assert len(list(path.glob("model-*.safetensors"))) > 3 and (path / "model.safetensors.index.json").is_file()
    ids = tokens(50, seed=8)
    r = runner(path, "invariant")
    assert_close(r.forward([SeqInput(r.allocate_slot(), ids, 0, num_logits=50)]), hf_logits(load_hf_model(path), ids))


def test_bf16_checkpoint_upcasts_to_float32(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    r = runner(path, "invariant")
    assert all(p.dtype == torch.float32 for p in r.model.parameters())
    ids = tokens(40, seed=9)
    hf = load_hf_model(path)  # upcasts the bf16 tensors to float32 as well
    assert_close(r.forward([SeqInput(r.allocate_slot(), ids, 0, num_logits=40)]), hf_logits(hf, ids))


def test_bfloat16_compute_runs_close_to_float32(checkpoints):
    ids = tokens(20, seed=10)
    fp32, bf16 = runner(checkpoints["qwen3"], "sdpa"), runner(checkpoints["qwen3"], "sdpa", dtype="bfloat16")
    ref = fp32.forward([SeqInput(fp32.allocate_slot(), ids, 0, num_logits=20)])
    out = bf16.forward([SeqInput(bf16.allocate_slot(), ids, 0, num_logits=20)])
    assert out.dtype == torch.float32 and bf16.kv_cache.k[0].dtype == torch.bfloat16
    assert (out - ref).abs().max() < 0.25 and (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def logits_three_ways(r: ModelRunner, prompt: list[int], cont: list[int], other: list[list[int]]):
    """Logits of positions len(prompt)-1 .. end computed (a) one token at a time, (b) in 5-token
    verification passes, (c) in 4-token passes batched with other prefills and decodes, (d) with the
    prompt itself fed one token at a time too."""
    full = prompt + cont

    def passes(chunk: int, neighbours: bool, prompt_chunk: int) -> torch.Tensor:
        slots = [r.allocate_slot() for _ in range(3 if neighbours else 1)]
        rows, pos = [], 0
        while pos < len(full):
            n = prompt_chunk if pos < len(prompt) else chunk
            n = min(n, len(prompt) - pos) if pos < len(prompt) else min(n, len(full) - pos)
            seqs = [SeqInput(slots[0], full[pos : pos + n], pos, num_logits=n)]
            if neighbours:  # a long prefill before and a decode after, in fresh / growing slots
                seqs.insert(0, SeqInput(slots[1], other[0], 0, num_logits=2))
                seqs.append(SeqInput(slots[2], other[1][: pos % 7 + 1], 0))
            out = r.forward(seqs)
            rows.append(out[2 : 2 + n] if neighbours else out)
            pos += n
        for slot in slots:
            r.free_slot(slot)
        return torch.cat(rows)[len(prompt) - 1 :]

    return {
        "one_at_a_time": passes(1, False, len(prompt)),
        "verify_5": passes(5, False, len(prompt)),
        "batched_4": passes(4, True, len(prompt)),
        "token_by_token_prompt": passes(1, False, 1),
    }


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_batch_invariant_kernels_are_bit_exact(checkpoints, arch):
    """Greedy speculative decoding is lossless only if a position's logits ignore the batch shape."""
    r = runner(checkpoints[arch], "invariant", num_slots=3, max_seq_len=256)
    results = logits_three_ways(r, tokens(70, seed=11), tokens(14, seed=12), [tokens(100, 13), tokens(7, 14)])
    ref = results.pop("one_at_a_time")
    for name, logits in results.items():
        assert torch.equal(logits, ref), f"{name}: max diff {(logits - ref).abs().max().item():.3g}"


def test_sdpa_kernels_agree_within_float32_noise(checkpoints):
    r = runner(checkpoints["qwen3"], "sdpa", num_slots=3, max_seq_len=256)
    results = logits_three_ways(r, tokens(70, seed=11), tokens(14, seed=12), [tokens(100, 13), tokens(7, 14)])
    ref = results.pop("one_at_a_time")
    for logits in results.values():
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_attention_memory_chunking_changes_no_bit(checkpoints, monkeypatch):
    """Long prefills are split into runs of query blocks and groups are cut to bound memory."""
    import minedraft.model.attention as attention

    ids, other = tokens(100, seed=15), tokens(9, seed=16)

    def run() -> torch.Tensor:
        r = runner(checkpoints["qwen3"], "invariant")
        a, b = r.allocate_slot(), r.allocate_slot()
        r.forward([SeqInput(b, other, 0)])
        return r.forward([SeqInput(a, ids, 0, num_logits=100), SeqInput(b, ids[:3], 9, num_logits=3)])

    ref = run()
    monkeypatch.setattr(attention, "_MAX_SCORES", 1)  # every query block of every sequence on its own
    assert torch.equal(run(), ref)
